"""Write a step's new K/V into the paged cache, each token at its slot (block * block_size +
offset). A negative slot is a padding token (a CUDA-graph bucket's unused rows): skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_vt, stride_cache_slot,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + slot * stride_cache_slot + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_cache_slot + offs, v, mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hk, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D], contiguous per slot;
    slot_mapping: [T] int. In place."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    k = k.reshape(num_tokens, row)
    v = v.reshape(num_tokens, row)
    if k.stride(1) != 1:
        k = k.contiguous()
    if v.stride(1) != 1:
        v = v.contiguous()
    assert k_cache.stride(1) == row and k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride()
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), v.stride(0), row,
        ROW=row, BLOCK=triton.next_power_of_2(row),
    )
