"""Paged attention in plain torch: K/V live in fixed-size blocks, read through block tables.

Every call first scatters the step's new K/V into their slots (slot_mapping), then
- batches all one-token queries (decodes) into one padded SDPA call over their
  blocks, masked by sequence length (and sliding window);
- runs each multi-token query (prefill chunk) as its own SDPA call with a causal
  mask offset by the tokens already in its cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.forward_context import AttentionMetadata, PrefillSegment, get_attention_metadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the model runner.
        self.kv_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] → [T, Hq, D]."""
        md = get_attention_metadata()
        if md is None or self.kv_cache.numel() == 0:
            return self._causal(q, k, v)
        k_cache, v_cache = self.kv_cache[0], self.kv_cache[1]
        block_size = k_cache.shape[1]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, md.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, md.slot_mapping, v)

        out = torch.empty_like(q)
        if md.decode_token_idx is not None:
            out[md.decode_token_idx] = self._decode(q[md.decode_token_idx], k_cache, v_cache, md, block_size)
        for seg in md.prefills:
            rows = slice(seg.token_start, seg.token_start + seg.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, seg)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        block_size: int,
    ) -> torch.Tensor:
        tables = md.decode_block_tables
        num_seqs, num_blocks = tables.shape
        max_len = num_blocks * block_size
        flat = tables.flatten()
        keys = k_cache.index_select(0, flat).view(num_seqs, max_len, self.num_kv_heads, self.head_dim)
        values = v_cache.index_select(0, flat).view(num_seqs, max_len, self.num_kv_heads, self.head_dim)
        masked_out = md.decode_masks.get(self.sliding_window)
        if masked_out is None:
            pos = torch.arange(max_len, device=q.device)
            seq_lens = md.decode_seq_lens[:, None]
            mask = pos[None, :] < seq_lens
            if self.sliding_window is not None:
                mask &= pos[None, :] >= seq_lens - self.sliding_window
            masked_out = md.decode_masks[self.sliding_window] = ~mask[:, None, None, :]
        # Plain matmuls (for one query token per sequence ~10x faster on CPU than SDPA with a
        # mask) in the cache's dtype, as the reference's bf16 attention does, so the gathered
        # K/V need no float32 copy; the softmax is in float32.
        group = self.num_heads // self.num_kv_heads
        qg = q.view(num_seqs, self.num_kv_heads, group, self.head_dim)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * self.scale  # [B, Hk, G, L]
        scores.masked_fill_(masked_out, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1).to(q.dtype), values.transpose(1, 2))  # [B, Hk, G, D]
        return out.reshape(num_seqs, self.num_heads, self.head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seg: PrefillSegment,
    ) -> torch.Tensor:
        if seg.context_len == 0:
            return self._causal(q, k, v)
        total = seg.context_len + seg.query_len
        keys = k_cache.index_select(0, seg.block_table).view(-1, self.num_kv_heads, self.head_dim)[:total]
        values = v_cache.index_select(0, seg.block_table).view(-1, self.num_kv_heads, self.head_dim)[:total]
        q_pos = torch.arange(seg.context_len, total, device=q.device)[:, None]
        k_pos = torch.arange(total, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask &= k_pos > q_pos - self.sliding_window
        # Same float32 matmul path as decode (SDPA with an explicit mask is slow on CPU).
        group = self.num_heads // self.num_kv_heads
        qf = q.view(seg.query_len, self.num_kv_heads, group, self.head_dim).permute(1, 2, 0, 3).float()
        scores = torch.matmul(qf, keys.permute(1, 2, 0).float().unsqueeze(1)) * self.scale  # [Hk, G, Lq, Lk]
        scores.masked_fill_(~mask, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), values.transpose(0, 1).float().unsqueeze(1))  # [Hk, G, Lq, D]
        return out.permute(2, 0, 1, 3).reshape(seg.query_len, self.num_heads, self.head_dim).to(q.dtype)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention among the new tokens alone (no cached context)."""
        n = q.shape[0]
        if self.sliding_window is None or n <= self.sliding_window:
            return self._sdpa(q, k, v, is_causal=True)
        pos = torch.arange(n, device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.sliding_window)
        return self._sdpa(q, k, v, mask=mask)

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.transpose(0, 1)
