"""Unified paged attention: one kernel for a mixed step (decodes, prefill chunks, chunks after
cached context), reading K/V in place through the block tables, with no dense gather.

A program takes BLOCK_Q query tokens of one sequence and every query head of one KV head (GQA:
BLOCK_Q x group rows share each K/V tile they load), and walks that sequence's keys in tiles of
BLOCK_N with an online softmax in float32: causal by position, limited to a sliding window and
soft-capped where the layer asks. Programs map onto sequences by a binary search over
`query_start_loc`, so the grid depends only on the token and sequence counts, which a CUDA graph
of a decode batch fixes. A byte cache (`--kv-cache-dtype`) is read as bytes and its group
scales, each tile turned into values in the query's dtype as it is loaded.

Where the sequences give too few programs to fill the GPU, each program walks one of NUM_SPLITS
ranges of its sequence's keys and leaves partial sums for split_kv.merge_splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm import envs
from pagedllm.model_executor.layers.triton_ops.kv_cache import kv_kind
from pagedllm.model_executor.layers.triton_ops.split_kv import merge_splits, num_kv_splits, partial_buffers


@triton.jit
def _find_seq(query_start_ptr, num_seqs, qb, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks hold program `qb`: sequence i's blocks start at
    query_start[i] // BLOCK_Q + i (an upper bound on the blocks before it, so none overlap)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if start <= qb:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _bytes_to_float(raw, KV_KIND: tl.constexpr):
    """A byte cache's elements (uint8 as stored) as float32."""
    if KV_KIND == 1:  # kv_cache.KV_INT8
        x = raw.to(tl.int8, bitcast=True).to(tl.float32)
    elif KV_KIND == 2:  # KV_E4M3
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:  # KV_E5M2
        x = raw.to(tl.float8e5, bitcast=True).to(tl.float32)
    return x


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, part_ptr, ml_ptr,
    num_seqs, num_tokens, num_heads, scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_sb, stride_ss, stride_sh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    KV_KIND: tl.constexpr, SCALE_GROUP: tl.constexpr, NUM_SCALES: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_ptr, num_seqs, qb, BLOCK_Q)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    q_first = (qb - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # this program's first query row
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    # Rows: query token q_first + m // BLOCK_G, head kv_head * GROUP + m % BLOCK_G.
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_idx = q_first + offs_m // BLOCK_G
    g = offs_m % BLOCK_G
    row_ok = (q_idx < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_s = tl.arange(0, BLOCK_D // SCALE_GROUP)  # a byte cache's scales of a head vector
    s_ok = offs_s < NUM_SCALES
    token = (q_begin + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = context + q_idx  # each row's own position: it sees keys 0..pos

    last = context + tl.minimum(q_first + BLOCK_Q, q_len)  # one past the last key any row reads
    first = 0
    if USE_WINDOW:
        first = tl.maximum(context + q_first - window + 1, 0)
        first = (first // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:  # this program's share of the tiles (none for a split past a short sequence)
        split = tl.program_id(2)
        per_split = tl.cdiv(tl.cdiv(last - first, BLOCK_N), NUM_SPLITS) * BLOCK_N
        first = first + split * per_split
        last = tl.minimum(last, first + per_split)

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(first, last, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k_ok = keys < last
        block = tl.load(table + keys // KV_BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = keys % KV_BLOCK_SIZE
        at = block * stride_sb + slot * stride_ss + kv_head * stride_sh  # a byte cache's scales (unused otherwise)
        k_ptrs = k_cache_ptr + block[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh \
            + offs_d[:, None]
        k_mask = k_ok[None, :] & d_ok[:, None]
        if KV_KIND == 0:  # KV_FLOAT
            k = tl.load(k_ptrs, mask=k_mask, other=0.0)  # [BLOCK_D, BLOCK_N]
        else:
            # A byte cache: each element times its group's scale (the same block, slot and head;
            # NUM_SCALES of them, one per SCALE_GROUP elements), loaded once per group and
            # broadcast, then rounded to the query's dtype (kv_quant.dequantize).
            k_scales = tl.load(k_scale_ptr + at[None, :] + offs_s[:, None], mask=k_ok[None, :] & s_ok[:, None],
                               other=0.0)  # [BLOCK_D // SCALE_GROUP, BLOCK_N]
            k = _bytes_to_float(tl.load(k_ptrs, mask=k_mask, other=0), KV_KIND)
            k = tl.reshape(tl.reshape(k, [BLOCK_D // SCALE_GROUP, SCALE_GROUP, BLOCK_N]) * k_scales[:, None, :],
                           [BLOCK_D, BLOCK_N]).to(q.dtype)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee") * scale
        elif DOT_F32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32)) * scale
        else:
            s = tl.dot(q, k) * scale
        if USE_SOFTCAP:  # cap * tanh(s / cap), tanh through the sigmoid
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        seen = (keys[None, :] <= pos[:, None]) & k_ok[None, :]
        if USE_WINDOW:
            seen = seen & (keys[None, :] > pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh \
            + offs_d[None, :]
        v_mask = k_ok[:, None] & d_ok[None, :]
        if KV_KIND == 0:  # KV_FLOAT
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        else:
            v_scales = tl.load(v_scale_ptr + at[:, None] + offs_s[None, :], mask=k_ok[:, None] & s_ok[None, :],
                               other=0.0)  # [BLOCK_N, BLOCK_D // SCALE_GROUP]
            v = _bytes_to_float(tl.load(v_ptrs, mask=v_mask, other=0), KV_KIND)
            v = tl.reshape(tl.reshape(v, [BLOCK_N, BLOCK_D // SCALE_GROUP, SCALE_GROUP]) * v_scales[:, :, None],
                           [BLOCK_N, BLOCK_D]).to(q.dtype)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        elif DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # the partial sums, [split, token, head]: max and sum side by side, then the output
        part = (tl.program_id(2) * num_tokens + token) * num_heads + head
        tl.store(ml_ptr + 2 * part, m_i, mask=row_ok)
        tl.store(ml_ptr + 2 * part + 1, l_i, mask=row_ok)
        tl.store(part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


def block_q_for(max_query_len: int, group: int) -> int:
    """Query tokens per program: decode-only steps take one (rows = the group's heads, padded to
    16 for the tensor cores), steps with prompt chunks enough for 64 rows."""
    block_g = triton.next_power_of_2(group)
    rows = 16 if max_query_len <= 1 else 64
    return max(1, rows // block_g)


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    element: torch.dtype | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q, out: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D]; block_tables:
    [R, max_blocks] int32; seq_lens: [R] int32 (context + this step's query); query_start_loc:
    [R + 1] int32, each sequence's first token in q. `max_query_len` picks the tile shape (a
    bound suffices: the grid depends only on T and R). A byte cache (uint8) also takes `scales`
    (K's and V's, [num_blocks, block_size, Hk, groups] float32) and its `element` type.
    `num_splits` (a power of two) overrides num_kv_splits."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    _, kv_block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0:
        return out
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_q = block_q_for(max_query_len, group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Keys per tile: wide enough for the tensor cores, small enough for the registers at 256-wide heads.
    block_n = max(16, min(64, 8192 // block_d))
    splits = num_splits or num_kv_splits(num_seqs, num_kv_heads, max_query_len, block_q, q.device)
    assert splits & (splits - 1) == 0, "the split count is a power of two"
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    part = ml = out  # unread with one split
    if splits > 1:
        part, ml = partial_buffers(splits, num_tokens, num_heads, head_dim, q.device)
    # Triton's CPU interpreter multiplies 16-bit floats by their bits: it gets exact float32
    # copies (the tensor cores also sum in float32).
    interpreted = envs.TRITON_INTERPRET
    k_scales, v_scales = scales if scales is not None else (k_cache, v_cache)  # unread for a float cache
    # A byte cache's scales per head vector, and the elements each covers, padded to BLOCK_D:
    # groups of 32 where head_dim is a multiple of 32, else one scale for the whole vector.
    num_scales = k_scales.shape[3] if scales is not None else 1
    scale_group = block_d if num_scales == 1 else head_dim // num_scales
    if scales is not None:
        assert k_scales.stride() == v_scales.stride() and k_scales.stride(3) == 1 and block_d % scale_group == 0
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, k_scales, v_scales,
        block_tables, seq_lens, query_start_loc, part, ml,
        num_seqs, num_tokens, num_heads, scale, softcap or 0.0, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        k_scales.stride(0), k_scales.stride(1), k_scales.stride(2),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_Q=block_q, BLOCK_N=block_n, KV_BLOCK_SIZE=kv_block_size,
        USE_SOFTCAP=softcap is not None and softcap > 0, USE_WINDOW=sliding_window is not None,
        IEEE=q.dtype == torch.float32, DOT_F32=interpreted and q.dtype != torch.float32,
        KV_KIND=kv_kind(element if scales is not None else None),
        SCALE_GROUP=scale_group, NUM_SCALES=num_scales, NUM_SPLITS=splits,
    )
    if splits > 1:
        merge_splits(part, ml, out)
    return out
