"""Paged attention against dense attention over each sequence's own keys, in float64.

Blocks are scattered at random over the cache, sequences have different lengths, and the
batches mix decodes with prefill chunks that have cached context, so the block tables,
the slot mapping and the sliding-window block skipping are all exercised. Every test runs
through the torch path and through each build of pagedllm's C kernel this CPU can run (the
torch path where none is built, asserted).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.forward_context import set_forward_context
from pagedllm.model_executor.layers import attention as attention_module
from pagedllm.model_executor.layers import cpu_kernels, kv_quant
from pagedllm.model_executor.layers.attention import Attention, causal_tiles, decode_view
from pagedllm.worker.step_inputs import prepare_inputs
from tests.model_executor.layers.conftest import kernel_levels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 4
SCALE = 0.3


@pytest.fixture(autouse=True, params=["torch", *kernel_levels()])
def decode_calls(request, monkeypatch):
    """Runs the test on one decode path (torch's, or each C kernel build); yields a check of
    the C kernel calls made."""
    calls = []
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    elif request.param is not None:
        monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernels.load(request.param))
    kernel = cpu_kernels.paged_decode_attention
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda *a: calls.append(1) or kernel(*a))
    expected = request.param != "torch" and cpu_kernels.kernels() is not None

    def check(batches: int) -> None:
        """One kernel call per decode batch where the kernel runs; none where the torch path does."""
        assert len(calls) == (batches if expected else 0)

    yield check


def _reference(q, keys, values, positions, window):
    """q: [Lq, H, D] at `positions`; keys/values: [L, Hk, D] of the whole sequence."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    kpos = torch.arange(keys.shape[0])[None, :]
    qpos = torch.as_tensor(positions)[:, None]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _run(seq_lens, query_lens, window, dtype=torch.float32, seed=0, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
         kv_cache_dtype="auto"):
    """Sequences whose first seq_len - query_len tokens are cached; the rest are this step's. A
    quantized cache (`kv_cache_dtype`) is compared with the reference over its stored values."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    attn = Attention(heads, head_dim, kv_heads, SCALE, window)
    quant = attn.kv_quant = kv_quant.kv_quant_for(kv_cache_dtype)
    shape = (2, num_blocks, BLOCK, kv_heads, head_dim)
    attn.kv_cache = torch.zeros(shape, dtype=dtype if quant is None else torch.uint8)
    if quant is not None:
        attn.kv_scales = torch.zeros(*shape[:-1], kv_quant.groups_per_head(head_dim))
    block_ids, seqs = [], []
    for n in seq_lens:
        ids = [perm.pop() for _ in range(-(-n // BLOCK))]
        block_ids.append(ids)
        kv = torch.randn(2, n, kv_heads, head_dim, generator=g).to(dtype)
        seqs.append(kv)
    starts = [n - ql for n, ql in zip(seq_lens, query_lens)]
    for ids, kv, start in zip(block_ids, seqs, starts):
        for pos in range(start):  # the cached context
            if quant is None:
                attn.kv_cache[:, ids[pos // BLOCK], pos % BLOCK] = kv[:, pos]
            else:
                attn.kv_cache[:, ids[pos // BLOCK], pos % BLOCK], attn.kv_scales[:, ids[pos // BLOCK], pos % BLOCK] = \
                    kv_quant.quantize(kv[:, pos], quant)
    token_ids = [[0] * ql for ql in query_lens]
    inputs = prepare_inputs(token_ids, starts, block_ids, BLOCK, torch.device("cpu"))
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    k = torch.cat([kv[0, s:] for kv, s in zip(seqs, starts)])
    v = torch.cat([kv[1, s:] for kv, s in zip(seqs, starts)])
    with set_forward_context(inputs.attn_metadata):
        out = attn(q, k, v)
    offset = 0
    for kv, n, ql in zip(seqs, seq_lens, query_lens):
        if quant is not None:
            kv = kv_quant.dequantize(*kv_quant.quantize(kv, quant), quant, torch.float64)
        ref = _reference(q[offset : offset + ql], kv[0], kv[1], list(range(n - ql, n)), window)
        torch.testing.assert_close(out[offset : offset + ql].double(), ref, **_tol(dtype))
        offset += ql
    return inputs.attn_metadata


def _tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_of_different_lengths(window, dtype, decode_calls):
    _run([3, 17, 9, 30], [1, 1, 1, 1], window, dtype)
    decode_calls(1)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 1, 256), (16, 1, 32), (12, 4, 64), (6, 2, 32)])
def test_decode_head_layouts(heads, kv_heads, head_dim, decode_calls):
    """Gemma 3's 4 query heads on one 256-wide kv head; groups wider than the kernel's
    8-head chunk; several kv heads."""
    _run([5, 21, 13], [1, 1, 1], 8, torch.bfloat16, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    _run([5, 21, 13], [1, 1, 1], None, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    decode_calls(2)


def test_nan_in_a_key_reaches_the_output(decode_calls):
    """A NaN score is not silently dropped by the softmax (as in the float reference)."""
    attn = Attention(HEADS, HEAD_DIM, KV_HEADS, SCALE)
    attn.kv_cache = torch.randn(2, 4, BLOCK, KV_HEADS, HEAD_DIM)
    attn.kv_cache[0, 0, 1, 0, 3] = float("nan")  # key 1 of the sequence, kv head 0
    inputs = prepare_inputs([[0]], [6], [[0, 1]], BLOCK, torch.device("cpu"))
    q, k, v = torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM)
    with set_forward_context(inputs.attn_metadata):
        out = attn(q, k, v)
    group = HEADS // KV_HEADS
    assert out[0, :group].isnan().all() and torch.isfinite(out[0, group:]).all()
    decode_calls(1)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seq_len", [1, 2, 7, 8, 23])
def test_single_decode_reads_exactly_its_keys(window, seq_len):
    _run([seq_len], [1], window)


@pytest.mark.parametrize("window", [None, 6])
def test_mixed_batch_of_decodes_and_prefills_with_context(window, decode_calls):
    _run([12, 20, 5, 9, 14], [1, 7, 5, 1, 3], window)
    decode_calls(1 + 2)  # the decodes; each chunk with context runs its rows as decodes


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_chunks_with_context_run_as_decodes_longer_ones_through_sdpa(window, dtype, decode_calls):
    """Up to KERNEL_CHUNK_ROWS rows (16 and 2 here) in the kernel; 17 rows, and a chunk
    without context, through SDPA: every row against the keys up to its own position."""
    rows = attention_module.KERNEL_CHUNK_ROWS
    _run([40, 33, 21, 9], [rows, rows + 1, 2, 9], window, dtype)
    decode_calls(2)


def test_chunks_over_more_keys_than_the_kernel_limit_go_through_sdpa(monkeypatch, decode_calls):
    """The kernel reads a row's keys once per row: past KERNEL_CHUNK_MAX_KEYS (30 here) a short
    chunk takes SDPA; under a window only the window's keys count."""
    monkeypatch.setattr(attention_module, "KERNEL_CHUNK_MAX_KEYS", 30)
    _run([40, 30], [4, 4], None)  # 40 keys: SDPA; 30: the kernel
    _run([40], [4], 6)  # 6 keys under the window: the kernel
    decode_calls(2)


def test_sliding_window_reads_only_the_blocks_in_the_window():
    md = _run([40, 37], [1, 1], window=6)
    view = decode_view(md, 6, BLOCK, torch.device("cpu"))
    # The earliest window starts at key 31 (37 - 6): blocks from 31 // 4 = 7 on, of 10.
    assert view.block_tables.shape == (2, 3)
    full = decode_view(md, None, BLOCK, torch.device("cpu"))
    assert full.block_tables.shape == (2, 10)
    lone = decode_view(_run([40], [1], window=6), 6, BLOCK, torch.device("cpu"))
    assert lone.block_tables.shape == (1, 2) and lone.masked_out is None
    assert (lone.first_key, lone.num_keys) == (2, 8)  # keys 34..39 of blocks 8 and 9


@pytest.mark.parametrize("context", [0, 9])
def test_long_prefill_under_a_window_runs_in_tiles_of_rows(context, monkeypatch):
    """Prefills longer than the tile, with and without cached context, beside a decode."""
    monkeypatch.setattr(attention_module, "WINDOW_TILE_ROWS", 4)
    _run([context + 23, 11], [23, 1], window=6)


@pytest.mark.parametrize("window, query_len, q_start", [(6, 23, 9), (3, 16, 0), (9, 12, 30)])
def test_tiles_read_only_the_keys_their_rows_can_see(window, query_len, q_start, monkeypatch):
    """Each tile's mask is the dense causal-window mask cut to its rows and keys, and nothing
    the tile leaves out is visible to its rows (windows below, at and above the tile size)."""
    monkeypatch.setattr(attention_module, "WINDOW_TILE_ROWS", 4)
    k_start = max(0, q_start + 1 - window) // BLOCK * BLOCK
    tiles = causal_tiles(q_start, query_len, k_start, window, torch.device("cpu"))
    q_pos = torch.arange(q_start, q_start + query_len)[:, None]
    k_pos = torch.arange(k_start, q_start + query_len)[None, :]
    dense = (k_pos <= q_pos) & (k_pos > q_pos - window)
    assert [t.rows for t in tiles] == [slice(lo, min(query_len, lo + 4)) for lo in range(0, query_len, 4)]
    for t in tiles:
        assert torch.equal(t.mask, dense[t.rows, t.keys])
        outside = dense[t.rows].clone()
        outside[:, t.keys] = False
        assert not outside.any()
        assert t.mask[:, 0].any()  # its first key is some row's window start: none read needlessly
    (whole,) = causal_tiles(q_start=9, query_len=23, k_start=0, window=None, device=torch.device("cpu"))
    assert whole.keys == slice(0, 32) and whole.mask.shape == (23, 32)


def test_uncached_attention_under_a_window_matches_dense(monkeypatch):
    """Without a KV cache (no forward context): a long query under a window, in tiles."""
    monkeypatch.setattr(attention_module, "WINDOW_TILE_ROWS", 4)
    g = torch.Generator().manual_seed(3)
    attn = Attention(HEADS, HEAD_DIM, KV_HEADS, SCALE, sliding_window=5)
    q = torch.randn(17, HEADS, HEAD_DIM, generator=g)
    k, v = torch.randn(2, 17, KV_HEADS, HEAD_DIM, generator=g)
    ref = _reference(q, k, v, list(range(17)), 5)
    torch.testing.assert_close(attn(q, k, v).double(), ref, **_tol(torch.float32))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cache_reads_its_stored_values_on_every_path(kv_cache_dtype, dtype, decode_calls):
    """Decodes, a short chunk run as decodes, a longer chunk through SDPA over gathered blocks, a
    fresh prompt (its own K/V read back as stored), under a window and not; Gemma 3's 256-wide head."""
    _run([3, 17, 9, 30], [1, 1, 1, 1], None, dtype, kv_cache_dtype=kv_cache_dtype)
    _run([5, 21, 40, 12], [1, 4, 24, 12], 8, dtype, kv_cache_dtype=kv_cache_dtype)
    _run([5, 21, 13], [1, 1, 6], None, heads=4, kv_heads=1, head_dim=256, kv_cache_dtype=kv_cache_dtype)
    decode_calls(5)
