"""Paged attention in plain torch: K/V live in fixed-size blocks, read through block tables.

Every call first scatters the step's new K/V into their slots (slot_mapping), then
- runs all one-token queries (decodes) in one call: on CPU pagedllm's C kernel, which reads
  the blocks in place; elsewhere batched GEMMs over their gathered blocks, masked by
  sequence length (and sliding window);
- runs each multi-token query (prefill chunk) through SDPA with a causal mask offset by the
  tokens already in its cache: one call, or under a sliding window one call per tile of query
  rows, each against only the keys its rows can see (SDPA computes every score of an explicit
  mask, so one call would cost the whole square). A short chunk with cached context (a small
  chunk of a long prompt, a speculative verification) runs its rows as decodes through the C
  kernel instead, each against the keys up to its own position.
Sliding-window layers read only the blocks that hold some query's window.

A quantized cache (`--kv-cache-dtype`, kv_quant.py) holds bytes and a scale per 32 of them: the
C kernels read them in place; SDPA reads the gathered blocks as values; and a prompt's own new
K/V are read back as stored, so every read of a token sees the same values however the prompt
was chunked.

Where the step carries Triton metadata (CUDA), the K/V go in and are read through the Triton
kernels instead (`triton_ops`): one launch for the whole mixed step, no gather, a byte cache
written and read by the kernels with kv_quant's roundings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.forward_context import AttentionMetadata, DecodeView, PrefillSegment, get_attention_metadata
from pagedllm.model_executor.custom_op import platform_of
from pagedllm.model_executor.layers import cpu_kernels, kv_quant
from pagedllm.model_executor.layers.kv_quant import KVQuant

# Query rows per SDPA call under a sliding window: a tile costs rows x (rows + window - 1)
# scores; smaller tiles waste fewer, at a call each (docs/performance.md, "row tiles").
WINDOW_TILE_ROWS = 128
# Most rows of a chunk with cached context that run as decodes in the C kernel: against SDPA
# over a 512-4,000-token context (AVX2 EPYC), 1.7-2.4x faster at 8 rows, even to 1.6x at 16,
# slower at 32 (its cost grows with the rows, SDPA's per-call cost does not).
KERNEL_CHUNK_ROWS = 16
# ... and at most this many keys per row (the kernel reads them once per row; SDPA once per
# chunk): the contexts measured, whose K/V stay in the CPU's caches.
KERNEL_CHUNK_MAX_KEYS = 4096


def chunk_runs_as_decodes(seg: PrefillSegment, sliding_window: int | None) -> bool:
    """Whether a prompt chunk runs its rows as decodes in the C kernel (each over the keys up to
    its own position): it follows cached context and has at most KERNEL_CHUNK_ROWS rows over at
    most KERNEL_CHUNK_MAX_KEYS keys under the layer's window. The decode plan takes a step by
    the same test. Never a chunk with bidirectional spans: its mask is not causal."""
    return not seg.bidirectional and causal_chunk_runs_as_decodes(seg.context_len, seg.query_len, sliding_window)


def causal_chunk_runs_as_decodes(context_len: int, query_len: int, sliding_window: int | None) -> bool:
    """`chunk_runs_as_decodes` for a causal chunk of `query_len` rows after `context_len` keys."""
    if context_len == 0:
        return False
    keys = context_len + query_len
    if sliding_window is not None:
        keys = min(keys, sliding_window)
    return query_len <= KERNEL_CHUNK_ROWS and keys <= KERNEL_CHUNK_MAX_KEYS


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None  # cap * tanh(scores / cap): Triton path only
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the model runner. A
        # quantized cache: uint8, with float32 scales [2, num_blocks, block_size, num_kv_heads, groups].
        self.kv_cache = torch.empty(0)
        self.kv_scales = torch.empty(0)
        self.kv_quant: KVQuant | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] → [T, Hq, D]."""
        md = get_attention_metadata()
        if md is not None and md.triton is not None and self.kv_cache.numel():
            return self._triton(q, k, v, md)
        if self.logits_soft_cap is not None:
            raise ValueError("soft-capped attention runs on the Triton kernels only (CUDA)")
        if md is None or self.kv_cache.numel() == 0:
            return self._causal(q, k, v)
        k_cache, v_cache = self.kv_cache[0], self.kv_cache[1]
        block_size = k_cache.shape[1]
        if self.kv_quant is None:
            k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, md.slot_mapping, k)
            v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, md.slot_mapping, v)
        else:
            kv_quant.write(k, v, md.slot_mapping, self.kv_cache, self.kv_scales, self.kv_quant)
            if any(seg.context_len == 0 for seg in md.prefills):  # a fresh prompt reads its own K/V: as stored
                k, v = kv_quant.read_slots(self.kv_cache, self.kv_scales, md.slot_mapping, self.kv_quant, q.dtype)

        if not md.prefills:  # decodes only: no scatter into a shared output
            return self._decode(q, k_cache, v_cache, md, block_size)
        out = torch.empty_like(q)
        if md.decode_token_idx is not None:
            out[md.decode_token_idx] = self._decode(q[md.decode_token_idx], k_cache, v_cache, md, block_size)
        for seg in md.prefills:
            rows = slice(seg.token_start, seg.token_start + seg.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, seg)
        return out

    def _triton(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Write the step's K/V by slot, then one unified attention launch over the block tables."""
        from pagedllm.model_executor.layers.triton_ops.kv_cache import reshape_and_cache
        from pagedllm.model_executor.layers.triton_ops.paged_attention import unified_attention

        t = md.triton
        k_cache, v_cache = self.kv_cache[0], self.kv_cache[1]
        quant = self.kv_quant
        scales = None if quant is None else (self.kv_scales[0], self.kv_scales[1])
        element = None if quant is None else quant.element
        reshape_and_cache(k, v, k_cache, v_cache, md.slot_mapping, scales, element, quant.qmax if quant else 0.0)
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return unified_attention(q, k_cache, v_cache, out, t.block_tables, t.seq_lens, t.query_start_loc,
                                 t.max_query_len, self.scale, self.sliding_window, self.logits_soft_cap,
                                 scales, element)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        block_size: int,
    ) -> torch.Tensor:
        if self._use_kernel(q):
            return cpu_kernels.paged_decode_attention(
                q, k_cache, v_cache, md.decode_block_tables, torch.from_numpy(md.decode_seq_lens),
                self.sliding_window, self.scale, self._kernel_scales(),
            )
        view = md.decode_views.get(self.sliding_window)
        if view is None:
            view = md.decode_views[self.sliding_window] = decode_view(md, self.sliding_window, block_size, q.device)
        num_seqs, num_blocks = view.block_tables.shape
        flat = view.block_tables.flatten()
        shape = (num_seqs, num_blocks * block_size, self.num_kv_heads, self.head_dim)
        keys = self._blocks(0, flat, q.dtype).view(shape)[:, view.first_key : view.num_keys]
        values = self._blocks(1, flat, q.dtype).view(shape)[:, view.first_key : view.num_keys]
        # Plain batched GEMMs (for one query token per sequence ~10x faster on CPU than SDPA with
        # a mask) in the cache's dtype, as the reference's bf16 attention does, so the gathered
        # K/V need no float32 copy; the softmax is in float32. 3-D `bmm`, not `matmul`: its 4-D
        # broadcasting costs ~30 us per call at batch 1.
        group = self.num_heads // self.num_kv_heads
        num_keys = view.num_keys - view.first_key
        batch = num_seqs * self.num_kv_heads
        qg = q.view(batch, group, self.head_dim)
        kt = keys.permute(0, 2, 3, 1).reshape(batch, self.head_dim, num_keys)
        scores = torch.bmm(qg, kt).float().mul_(self.scale).view(num_seqs, self.num_kv_heads, group, num_keys)
        if view.masked_out is not None:
            scores.masked_fill_(view.masked_out, float("-inf"))
        probs = scores.softmax(dim=-1).to(q.dtype).view(batch, group, num_keys)
        out = torch.bmm(probs, values.transpose(1, 2).reshape(batch, num_keys, self.head_dim))
        return out.view(num_seqs, self.num_heads, self.head_dim)

    def _blocks(self, i: int, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks `table` of the keys (i = 0) or values (1) as values in `dtype`:
        [len(table), block_size, num_kv_heads, head_dim]."""
        if self.kv_quant is None:
            return self.kv_cache[i].index_select(0, table)
        return kv_quant.gather(self.kv_cache[i], self.kv_scales[i], table, self.kv_quant, dtype)

    def _kernel_scales(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The C kernel's view of a quantized cache: the scales and the KV kind."""
        return None if self.kv_quant is None else (self.kv_scales[0], self.kv_scales[1], self.kv_quant.kind)

    def _use_kernel(self, q: torch.Tensor) -> bool:
        """pagedllm's C decode kernel: reads each sequence's keys in place through its block
        table, once for all query heads sharing them, with no gather and no padding mask."""
        return self.head_dim % 32 == 0 and platform_of(q) == "cpu"

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seg: PrefillSegment,
    ) -> torch.Tensor:
        if seg.bidirectional:
            return self._prefix_lm(q, k, v, k_cache, v_cache, seg)
        if seg.context_len == 0:  # every key is new: read them as computed, not from the cache
            return self._causal(q, k, v, seg, k_cache.shape[1])
        if chunk_runs_as_decodes(seg, self.sliding_window) and self._use_kernel(q):
            tables, lens = self._rows_as_decodes(seg)
            return cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, self.sliding_window,
                                                      self.scale, self._kernel_scales())
        table, num_keys, tiles = self._view(seg, k_cache.shape[1], q.device)
        keys = self._blocks(0, table, q.dtype).view(-1, self.num_kv_heads, self.head_dim)[:num_keys]
        values = self._blocks(1, table, q.dtype).view(-1, self.num_kv_heads, self.head_dim)[:num_keys]
        return self._tiled(q, keys, values, tiles)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: PrefillSegment | None = None,
                block_size: int = 0) -> torch.Tensor:
        """Attention among the new tokens alone; a long query under a window in tiles, shared
        by the layers through `seg` where there is one (their keys start at position 0)."""
        n = q.shape[0]
        if self.sliding_window is None or n <= self.sliding_window:
            return self._sdpa(q, k, v, is_causal=True)
        if seg is None:
            return self._tiled(q, k, v, causal_tiles(0, n, 0, self.sliding_window, q.device))
        return self._tiled(q, k, v, self._view(seg, block_size, q.device)[2])

    def _prefix_lm(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, seg: PrefillSegment) -> torch.Tensor:
        """A chunk with bidirectional spans (an image's tokens, whole in this chunk: the scheduler
        does not split them): one SDPA call over every key its rows can see, with the mask the
        layers share through `seg` (`prefix_lm_view`)."""
        key = ("prefix_lm", self.sliding_window)
        view = seg.views.get(key)
        if view is None:
            view = seg.views[key] = prefix_lm_view(seg, self.sliding_window, k_cache.shape[1], q.device)
        table, num_keys, mask = view
        if seg.context_len == 0:  # every key is new
            return self._sdpa(q, k, v, mask=mask)
        keys = self._blocks(0, table, q.dtype).view(-1, self.num_kv_heads, self.head_dim)[:num_keys]
        values = self._blocks(1, table, q.dtype).view(-1, self.num_kv_heads, self.head_dim)[:num_keys]
        return self._sdpa(q, keys, values, mask=mask)

    @staticmethod
    def _rows_as_decodes(seg: PrefillSegment) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i as a decode of a sequence of context_len + i + 1 tokens (its own K/V already
        written: causal and windowed by its length, no mask): the block table for every row and
        the lengths, built by the first layer that asks."""
        rows = seg.views.get("rows")
        if rows is None:
            lens = torch.arange(seg.context_len + 1, seg.context_len + seg.query_len + 1)
            rows = seg.views["rows"] = (seg.block_table[None].expand(seg.query_len, -1), lens)
        return rows

    def _view(self, seg: PrefillSegment, block_size: int, device: torch.device) -> tuple[torch.Tensor, int, list]:
        """`prefill_view` under this layer's window, built by the first layer that asks."""
        view = seg.views.get(self.sliding_window)
        if view is None:
            view = seg.views[self.sliding_window] = prefill_view(seg, self.sliding_window, block_size, device)
        return view

    def _tiled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: list[AttentionTile]) -> torch.Tensor:
        if len(tiles) == 1:
            return self._sdpa(q, k[tiles[0].keys], v[tiles[0].keys], mask=tiles[0].mask)
        out = torch.empty_like(q)
        for t in tiles:
            out[t.rows] = self._sdpa(q[t.rows], k[t.keys], v[t.keys], mask=t.mask)
        return out

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        # 4-D inputs: for 3-D ones CPU SDPA falls back to its (~3x slower) math kernel.
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o[0].transpose(0, 1)


def decode_view(
    md: AttentionMetadata, window: int | None, block_size: int, device: torch.device
) -> DecodeView:
    """Which blocks and keys the batch's decodes read under `window`.

    A sliding-window layer reads only the block-table columns from the earliest window start
    on, so its cost stays bounded however long the sequences grow. A lone sequence reads
    exactly its keys and needs no mask."""
    lens = md.decode_seq_lens
    lo = np.maximum(lens - window, 0) if window is not None else np.zeros_like(lens)
    first_block = int(lo.min()) // block_size
    tables = md.decode_block_tables[:, first_block:]
    base = first_block * block_size
    if len(lens) == 1:
        return DecodeView(tables, int(lo[0]) - base, int(lens[0]) - base, None)
    num_keys = tables.shape[1] * block_size
    pos = torch.arange(base, base + num_keys, device=device)
    seq_lens = torch.from_numpy(lens).to(device)[:, None]
    mask = pos[None, :] < seq_lens
    if window is not None:
        mask &= pos[None, :] >= seq_lens - window
    return DecodeView(tables, 0, num_keys, ~mask[:, None, None, :])


def prefill_view(
    seg: PrefillSegment, window: int | None, block_size: int, device: torch.device
) -> tuple[torch.Tensor, int, list[AttentionTile]]:
    """What a prefill chunk (with cached context, or longer than `window`) reads under
    `window`: the block-table slice from the block holding its earliest query's window start
    (block 0 without context), the number of keys in it, and the tiles of query rows that read
    them (`causal_tiles`)."""
    total = seg.context_len + seg.query_len
    first = 0
    if window is not None:
        first = max(0, seg.context_len + 1 - window) // block_size * block_size
    tiles = causal_tiles(seg.context_len, seg.query_len, first, window, device)
    return seg.block_table[first // block_size :], total - first, tiles


def prefix_lm_view(
    seg: PrefillSegment, window: int | None, block_size: int, device: torch.device
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """What a chunk with bidirectional spans reads under `window`: the block-table slice from the
    block holding its earliest query's window start, the number of keys in it, and the mask
    [rows, keys]: causal, or both in one span; and (under a window) key > query - window, as
    the reference composes them (Gemma 3: AND(window, OR(causal, same image)))."""
    total = seg.context_len + seg.query_len
    first = 0
    if window is not None and seg.context_len:
        first = max(0, seg.context_len + 1 - window) // block_size * block_size
    q_pos = torch.arange(seg.context_len, total, device=device)[:, None]
    k_pos = torch.arange(first, total, device=device)[None, :]
    mask = k_pos <= q_pos
    for start, end in seg.bidirectional:
        mask |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if window is not None:
        mask &= k_pos > q_pos - window
    return seg.block_table[first // block_size :], total - first, mask


@dataclass(slots=True)
class AttentionTile:
    rows: slice  # query rows
    keys: slice  # the keys they read, as indices into the keys passed with them
    mask: torch.Tensor  # [rows, keys]: causal, and within the window


def causal_tiles(
    q_start: int, query_len: int, k_start: int, window: int | None, device: torch.device
) -> list[AttentionTile]:
    """Split a query at positions q_start.. over keys at positions k_start..(its own last
    position) into SDPA calls. Without a window, one call over every key; under a window,
    tiles of `WINDOW_TILE_ROWS` rows, each over only the keys from its first row's window
    start to its last row."""
    step = max(1, query_len) if window is None else WINDOW_TILE_ROWS
    tiles = []
    for lo in range(0, query_len, step):
        hi = min(query_len, lo + step)
        first_key = k_start if window is None else max(k_start, q_start + lo - window + 1)
        q_pos = torch.arange(q_start + lo, q_start + hi, device=device)[:, None]
        k_pos = torch.arange(first_key, q_start + hi, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        tiles.append(AttentionTile(slice(lo, hi), slice(first_key - k_start, q_start + hi - k_start), mask))
    return tiles
