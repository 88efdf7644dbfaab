"""The unified paged-attention kernel against plain torch: decode rows, prefill chunks with
and without cached context, mixed steps, block tables with holes, GQA, sliding windows and
soft-capping. Under Triton's interpreter without a GPU, natively with one."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.model_executor.layers.triton_ops.kv_cache import reshape_and_cache
from pagedllm.model_executor.layers.triton_ops.paged_attention import unified_attention


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


def run_case(device, dtype, seqs, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, window=None,
             softcap=None, num_blocks=64, seed=0):
    """seqs: (context_len, query_len) per sequence. Each sequence gets scattered, shuffled blocks
    (holes between them hold garbage) and its context K/V written first; the step's K/V go in
    through reshape_and_cache, as in a forward pass."""
    gen = torch.Generator().manual_seed(seed)
    scale = 1 / math.sqrt(head_dim)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-(c + n) // block_size) for c, n in seqs)
    tables = torch.zeros(len(seqs), max_blocks + 2, dtype=torch.int32)  # wider than needed
    qs, ks, vs, slots, full_k, full_v = [], [], [], [], [], []
    for i, (ctx, n) in enumerate(seqs):
        total = ctx + n
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        kk = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        vv = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        seq_slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(total)])
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:ctx]] = kk[:ctx]
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:ctx]] = vv[:ctx]
        qs.append(torch.randn(n, num_heads, head_dim, generator=gen).to(dtype))
        ks.append(kk[ctx:])
        vs.append(vv[ctx:])
        slots.append(seq_slots[ctx:])
        full_k.append(kk)
        full_v.append(vv)
    q = torch.cat(qs).to(device)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    reshape_and_cache(torch.cat(ks).to(device), torch.cat(vs).to(device), k_cache, v_cache,
                      torch.cat(slots).to(device))
    lens = [n for _, n in seqs]
    query_start = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    unified_attention(q, k_cache, v_cache, out, tables.to(device), seq_lens, query_start, max(lens), scale,
                      window, softcap)
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
