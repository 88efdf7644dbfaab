"""Write a step's new K/V into the paged cache, each token at its slot (block * block_size +
offset). A negative slot is a padding token (a CUDA-graph bucket's unused rows): skipped.

A byte cache (`--kv-cache-dtype`, kv_quant.py) stores each group of a token's kv-head vector as
bytes with a float32 scale, rounded exactly as kv_quant.quantize rounds on the CPU: the scale is
the group's absmax / qmax (IEEE division), each value x / scale clamped to ±qmax, then rounded to
nearest-even as an int8 or a float8 (e4m3fn / e5m2). The float8 bytes are built from the float32
bits here rather than by the compiler's conversion, which Triton's CPU interpreter gets wrong
where the rounding carries into the exponent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The byte kinds (KV_KIND): the element each byte of the cache holds.
KV_FLOAT, KV_INT8, KV_E4M3, KV_E5M2 = 0, 1, 2, 3
_KIND_OF = {torch.int8: KV_INT8, torch.float8_e4m3fn: KV_E4M3, torch.float8_e5m2: KV_E5M2}


def kv_kind(element: torch.dtype | None) -> int:
    """The kernels' id of a byte cache's element type (None: a float cache)."""
    return KV_FLOAT if element is None else _KIND_OF[element]


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


@triton.jit
def _round_even(y):
    """Round to nearest, ties to even, in float32 arithmetic that is exact for |y| < 2^22."""
    fl = tl.floor(y)
    frac = y - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), fl + 1.0, fl)


@triton.jit
def _float8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """The float8 byte (MANT mantissa bits, exponent bias BIAS) nearest to y, ties to even; |y|
    is within the format's finite range."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    drop: tl.constexpr = 23 - MANT
    # Normal: round the float32 mantissa to MANT bits (a carry moves into the exponent), re-bias.
    rounded = (a + ((1 << (drop - 1)) - 1) + ((a >> drop) & 1)) >> drop
    normal = rounded - ((127 - BIAS) << MANT)
    # Below the smallest normal 2^(1 - BIAS): a multiple of the subnormal step 2^(1 - BIAS - MANT),
    # whose count up to 2^MANT is the byte itself (2^MANT encodes the smallest normal).
    sub = _round_even(tl.minimum(tl.abs(y) * (1 << (BIAS + MANT - 1)), 1 << MANT)).to(tl.int32)
    small = a < ((128 - BIAS) << 23)
    return (tl.where(small, sub, normal) | sign).to(tl.uint8)


@triton.jit
def _quantize_row(src_ptr, dst_ptr, scale_ptr, groups, offs, mask, g, QMAX: tl.constexpr, KIND: tl.constexpr):
    """One token's row [groups, group size] → bytes at dst_ptr and a scale per group at scale_ptr."""
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), 1), QMAX)
    scale = tl.where(scale > 0.0, scale, 1.0)
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if KIND == 1:  # KV_INT8
        q = _round_even(y).to(tl.int32).to(tl.uint8)  # two's complement byte of the int8
    elif KIND == 2:  # KV_E4M3
        q = _float8_bits(y, 3, 7)
    else:  # KV_E5M2
        q = _float8_bits(y, 2, 15)
    tl.store(dst_ptr + offs, q, mask=mask)
    tl.store(scale_ptr + g, scale, mask=g < groups)


@triton.jit
def _quantize_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_vt,
    GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    QMAX: tl.constexpr, KIND: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_S)
    offs = g[:, None] * GROUP_SIZE + j[None, :]
    mask = (g[:, None] < GROUPS) & (j[None, :] < GROUP_SIZE)
    row = slot * (GROUPS * GROUP_SIZE)
    _quantize_row(k_ptr + t * stride_kt, k_cache_ptr + row, k_scale_ptr + slot * GROUPS, GROUPS, offs, mask, g,
                  QMAX, KIND)
    _quantize_row(v_ptr + t * stride_vt, v_cache_ptr + row, v_scale_ptr + slot * GROUPS, GROUPS, offs, mask, g,
                  QMAX, KIND)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(x.shape[0], -1)
    return x if x.stride(1) == 1 else x.contiguous()


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                      element: torch.dtype | None = None, qmax: float = 0.0) -> None:
    """k, v: [T, Hk, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D], contiguous per slot;
    slot_mapping: [T] int. In place. A byte cache (uint8) also takes `scales` (the K and V scales,
    [num_blocks, block_size, Hk, groups] float32), its `element` type and `qmax`."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    k, v = _rows(k), _rows(v)
    assert k_cache.stride(1) == row and k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride()
    if scales is None:
        _reshape_and_cache_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), v.stride(0), row,
            ROW=row, BLOCK=triton.next_power_of_2(row),
        )
        return
    k_scales, v_scales = scales
    groups = num_kv_heads * k_scales.shape[-1]
    group_size = row // groups
    assert k_cache.dtype == torch.uint8 and k_scales.is_contiguous() and v_scales.is_contiguous()
    _quantize_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping,
        k.stride(0), v.stride(0),
        GROUPS=groups, GROUP_SIZE=group_size, BLOCK_G=triton.next_power_of_2(groups),
        BLOCK_S=triton.next_power_of_2(group_size), QMAX=qmax, KIND=kv_kind(element),
    )
