"""The grammar bitmask applied to the logits in place on the device: logits[rows[i], t] = -inf
where bit t of bitmask[i] is 0 (xgrammar's layout: little-endian bits in int32 words)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # vocabulary entries per program


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, stride_logits, stride_mask,
                          BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    words = tl.load(bitmask_ptr + i * stride_mask + offs // 32, mask=in_vocab, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + offs, tl.full([BLOCK], float("-inf"), tl.float32),
             mask=in_vocab & banned)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits: [N, V] on the device; bitmask: [R, ceil(V / 32)] int32 (the device's or the
    host's); rows: [R] the logits row each bitmask row masks."""
    if rows.numel() == 0:
        return
    assert logits.stride(1) == 1
    bitmask = bitmask.to(logits.device, non_blocking=True).contiguous()
    rows = rows.to(logits.device, non_blocking=True)
    vocab = logits.shape[1]
    grid = (rows.numel(), triton.cdiv(vocab, _BLOCK))
    _apply_bitmask_kernel[grid](logits, bitmask, rows, vocab, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK)
