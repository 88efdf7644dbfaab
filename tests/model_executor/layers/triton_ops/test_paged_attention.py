"""The unified paged-attention kernel against plain torch: decode rows, prefill chunks with
and without cached context, mixed steps, block tables with holes, GQA, sliding windows and
soft-capping, over float and byte caches (`--kv-cache-dtype`, whose writes must store exactly
kv_quant's bytes and scales). Under Triton's interpreter without a GPU, natively with one."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.model_executor.layers import kv_quant
from pagedllm.model_executor.layers.triton_ops.kv_cache import reshape_and_cache
from pagedllm.model_executor.layers.triton_ops.paged_attention import unified_attention

BYTE_KINDS = ["int8", "fp8_e4m3", "fp8_e5m2"]


def reference(q, k_seq, v_seq, context, scale, window, softcap):
    """One sequence: q [L, Hq, D] at positions context..context+L-1 over keys k_seq/v_seq
    [context + L, Hk, D], causal, in float64."""
    num_q, num_heads, _ = q.shape
    group = num_heads // k_seq.shape[1]
    k = k_seq.double().repeat_interleave(group, dim=1)
    v = v_seq.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(context, context + num_q)[:, None]
    keys = torch.arange(k.shape[0])[None, :]
    seen = keys <= pos
    if window:
        seen &= keys > pos - window
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


class Cache:
    """The K and V caches of one layer, float or bytes with their scales (kv_quant's layout),
    filled with garbage."""

    def __init__(self, gen, num_blocks, block_size, num_kv_heads, head_dim, dtype, kv):
        self.quant = kv_quant.kv_quant_for(kv)
        self.hk, self.d, self.dtype = num_kv_heads, head_dim, dtype
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        if self.quant is None:
            self.data = torch.randn(*shape, generator=gen).to(dtype)
            self.scales = None
        else:
            self.data = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            self.scales = torch.rand(*shape[:-1], kv_quant.groups_per_head(head_dim), generator=gen)

    def put(self, slots, k, v):
        """Store K/V at `slots` as the torch reference stores them (the context of a step)."""
        for i, x in enumerate((k, v)):
            if self.quant is None:
                self.data[i].view(-1, self.hk, self.d)[slots] = x
            else:
                data, scales = kv_quant.quantize(x, self.quant)
                self.data[i].view(-1, self.hk, self.d)[slots] = data
                self.scales[i].view(-1, self.hk, scales.shape[-1])[slots] = scales

    def seen(self, x):
        """What a read of stored K/V gives: a byte cache's rounding, in the query's dtype."""
        return x if self.quant is None else kv_quant.dequantize(*kv_quant.quantize(x, self.quant), self.quant,
                                                                 self.dtype)

    def to(self, device):
        self.data = self.data.to(device)
        self.scales = None if self.scales is None else self.scales.to(device)
        return self

    def kernel_args(self):
        """(k_cache, v_cache, scales, element) as reshape_and_cache and unified_attention take them."""
        scales = None if self.scales is None else (self.scales[0], self.scales[1])
        return self.data[0], self.data[1], scales, None if self.quant is None else self.quant.element


def run_case(device, dtype, seqs, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, window=None,
             softcap=None, num_blocks=64, seed=0, kv="auto", q_mag=1.0, v_mag=1.0, num_splits=None):
    """seqs: (context_len, query_len) per sequence. Each sequence gets scattered, shuffled blocks
    (holes between them hold garbage) and its context K/V written first; the step's K/V go in
    through reshape_and_cache, as in a forward pass. `kv`: the cache dtype (a byte kind's keys
    get outlier channels, as real keys have). q_mag, v_mag: the queries' and values' size.
    num_splits: split-KV's ranges per sequence (default: the kernel's choice)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 1 / (math.sqrt(head_dim) * q_mag)
    cache = Cache(gen, num_blocks, block_size, num_kv_heads, head_dim, dtype, kv)
    channel = torch.ones(head_dim) if kv == "auto" else 1 + 7 * (torch.rand(head_dim, generator=gen) > 0.9)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-(c + n) // block_size) for c, n in seqs)
    tables = torch.zeros(len(seqs), max_blocks + 2, dtype=torch.int32)  # wider than needed
    qs, ks, vs, slots, full_k, full_v = [], [], [], [], [], []
    for i, (ctx, n) in enumerate(seqs):
        total = ctx + n
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        kk = (torch.randn(total, num_kv_heads, head_dim, generator=gen) * channel).to(dtype)
        vv = (torch.randn(total, num_kv_heads, head_dim, generator=gen) * v_mag).to(dtype)
        seq_slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(total)])
        cache.put(seq_slots[:ctx], kk[:ctx], vv[:ctx])
        qs.append((torch.randn(n, num_heads, head_dim, generator=gen) * q_mag).to(dtype))
        ks.append(kk[ctx:])
        vs.append(vv[ctx:])
        slots.append(seq_slots[ctx:])
        full_k.append(cache.seen(kk))
        full_v.append(cache.seen(vv))
    q = torch.cat(qs).to(device)
    k_cache, v_cache, scales, element = cache.to(device).kernel_args()
    qmax = cache.quant.qmax if cache.quant else 0.0
    reshape_and_cache(torch.cat(ks).to(device), torch.cat(vs).to(device), k_cache, v_cache,
                      torch.cat(slots).to(device), scales, element, qmax)
    lens = [n for _, n in seqs]
    query_start = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    unified_attention(q, k_cache, v_cache, out, tables.to(device), seq_lens, query_start, max(lens), scale,
                      window, softcap, scales, element, num_splits)
    ref = torch.cat([reference(qi, kk, vv, ctx, scale, window, softcap)
                     for qi, kk, vv, (ctx, _) in zip(qs, full_k, full_v, seqs)])
    return out.cpu().double(), ref


def tolerance(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", [
    [(5, 1), (17, 1), (40, 1)],                       # decodes only
    [(0, 23)],                                        # a prompt
    [(0, 7), (30, 1), (16, 20), (3, 1), (40, 5)],     # mixed: prompts, decodes, chunks after context
])
def test_matches_reference(device, dtype, seqs):
    out, ref = run_case(device, dtype, seqs)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("num_splits", [2, 4, 16])
@pytest.mark.parametrize("seqs", [
    [(5, 1), (150, 1), (70, 1), (0, 1)],              # decodes: splits past a short sequence's keys see none
    [(0, 7), (130, 1), (16, 20), (3, 1), (90, 5)],    # mixed
])
def test_split_kv_matches_reference(device, seqs, num_splits):
    """Each sequence's keys cut into ranges whose partial softmax sums are merged: the same
    attention, windowed and soft-capped too."""
    out, ref = run_case(device, torch.float32, seqs, num_splits=num_splits, num_blocks=48)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))
    out, ref = run_case(device, torch.float32, seqs, num_splits=num_splits, num_blocks=48, window=40, softcap=5.0)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@pytest.mark.parametrize("kv", BYTE_KINDS)
def test_split_kv_over_a_byte_cache(device, kv):
    out, ref = run_case(device, torch.bfloat16, [(200, 1), (3, 1), (60, 4)], kv=kv, num_splits=4, num_blocks=48)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


def test_split_count_fills_the_sms(monkeypatch):
    """A power of two up to MAX_SPLITS that brings the programs to two per SM; 1 off CUDA or
    where they already fill the GPU; the environment variable overrides it."""
    from pagedllm.model_executor.layers.triton_ops import split_kv

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(split_kv, "_sm_count", lambda index: 132)
    monkeypatch.delenv("PAGEDLLM_ATTENTION_KV_SPLITS", raising=False)
    assert split_kv.num_kv_splits(1, 8, 1, 4, cuda) == 16  # 264 / 8 programs = 33 -> 64 -> capped at 16
    assert split_kv.num_kv_splits(16, 8, 1, 4, cuda) == 4  # 264 / 128 -> 3 -> 4
    assert split_kv.num_kv_splits(64, 8, 1, 4, cuda) == 1
    assert split_kv.num_kv_splits(1, 8, 64, 16, cuda) == 16  # one 64-token chunk: 4 query blocks
    assert split_kv.num_kv_splits(2, 8, 512, 16, cuda) == 1  # prompts of 512: 32 query blocks each
    assert split_kv.num_kv_splits(1, 8, 1, 4, torch.device("cpu")) == 1
    monkeypatch.setenv("PAGEDLLM_ATTENTION_KV_SPLITS", "2")
    assert split_kv.num_kv_splits(1, 8, 1, 4, cuda) == 2
    for bad in ("3", "32"):
        monkeypatch.setenv("PAGEDLLM_ATTENTION_KV_SPLITS", bad)
        with pytest.raises(ValueError, match="PAGEDLLM_ATTENTION_KV_SPLITS"):
            split_kv.num_kv_splits(1, 8, 1, 4, cuda)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 2), (4, 1)])
def test_gqa_layouts(device, num_heads, num_kv_heads):
    out, ref = run_case(device, torch.float32, [(9, 1), (0, 12), (20, 6)], num_heads=num_heads,
                        num_kv_heads=num_kv_heads)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@pytest.mark.parametrize("window", [1, 8, 20])
def test_sliding_window(device, window):
    out, ref = run_case(device, torch.float32, [(50, 1), (0, 40), (33, 9), (7, 1)], window=window)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def test_soft_cap_and_window_together(device):
    out, ref = run_case(device, torch.float32, [(12, 1), (0, 30), (25, 4)], window=10, softcap=5.0)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@pytest.mark.parametrize("head_dim,block_size", [(16, 16), (48, 8), (256, 32)])
def test_head_dims_and_block_sizes(device, head_dim, block_size):
    out, ref = run_case(device, torch.float32, [(3, 1), (0, 19), (21, 3)], head_dim=head_dim,
                        block_size=block_size)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def test_padding_rows_are_skipped(device):
    """A CUDA-graph bucket's padding: slot -1 writes nothing, and a padded sequence's row
    leaves the real rows alone."""
    k_cache = torch.zeros(4, 16, 2, 32, device=device)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 2, 32, device=device)
    reshape_and_cache(k, k, k_cache, v_cache, torch.tensor([5, -1, 17], device=device))
    written = (k_cache.view(-1, 2, 32) != 0).any(-1).any(-1).nonzero().flatten().tolist()
    assert written == [5, 17]


@pytest.mark.parametrize("kv", BYTE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_byte_cache_matches_reference(device, dtype, kv):
    """Decodes, a fresh prompt and chunks after context over a byte cache: attention over the
    values the cache holds, the step's own K/V included (written by the kernel)."""
    out, ref = run_case(device, dtype, [(0, 7), (30, 1), (16, 20), (40, 5)], kv=kv)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("kv", BYTE_KINDS)
@pytest.mark.parametrize("q_mag,v_mag", [(3e4, 1e-6), (1e-5, 3e3)])
def test_byte_cache_far_from_unit_size(device, kv, q_mag, v_mag):
    """bf16 queries at 3e4 (past float16's range) or 1e-5, over values at 1e-6 or 3e3: nothing on
    the way (scales, tiles, partial sums) overflows or flushes to zero. The softmax scale shrinks
    with the queries so the reference's softmax is not one-hot."""
    out, ref = run_case(device, torch.bfloat16, [(0, 5), (37, 1), (20, 4)], kv=kv, q_mag=q_mag, v_mag=v_mag,
                        head_dim=64)
    torch.testing.assert_close(out / v_mag, ref / v_mag, **tolerance(torch.bfloat16))


@pytest.mark.parametrize("head_dim", [48, 128])
def test_byte_cache_head_dims_and_window(device, head_dim):
    """48: one scale per head vector (not a multiple of 32); 128: four groups per head."""
    out, ref = run_case(device, torch.float32, [(3, 1), (0, 19), (21, 3)], head_dim=head_dim, block_size=8,
                        window=9, kv="int8", num_heads=6, num_kv_heads=2)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@pytest.mark.parametrize("kv", BYTE_KINDS)
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 48), (torch.bfloat16, 128)])
def test_byte_cache_write_stores_kv_quant_bytes(device, dtype, head_dim, kv):
    """The kernel's bytes and scales equal kv_quant.quantize's bit for bit (its roundings: IEEE
    division, ties to even, float8 subnormals), on values spanning 11 decades, zeros and -0.0;
    padding slots write nothing."""
    quant = kv_quant.kv_quant_for(kv)
    gen = torch.Generator().manual_seed(1)
    num_tokens, hk = 7, 2
    k = (torch.randn(num_tokens, hk, head_dim, generator=gen) * torch.logspace(-8, 3, head_dim)).to(dtype)
    v = torch.randn(num_tokens, hk, head_dim, generator=gen).to(dtype)
    k[0, 0] = 0
    k[1, 1, :5] = -0.0
    v[2, 0, 3] = 0.5 * v[2, 0].abs().max()  # a value at a rounding tie for some kinds is likely somewhere
    groups = kv_quant.groups_per_head(head_dim)
    cache = torch.zeros(2, 4, 8, hk, head_dim, dtype=torch.uint8, device=device)
    scales = torch.zeros(2, 4, 8, hk, groups, device=device)
    slots = torch.tensor([3, -1, 9, 17, 31, 0, 12])
    reshape_and_cache(k.to(device), v.to(device), cache[0], cache[1], slots.to(device), (scales[0], scales[1]),
                      quant.element, quant.qmax)
    kept = slots >= 0
    for i, x in enumerate((k, v)):
        data, scale = kv_quant.quantize(x, quant)
        assert torch.equal(cache[i].cpu().view(-1, hk, head_dim)[slots[kept]], data[kept])
        assert torch.equal(scales[i].cpu().view(-1, hk, groups)[slots[kept]], scale[kept])
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert not cache.cpu().view(2, 32, -1)[:, untouched].any()
