"""A quantized KV cache (`--kv-cache-dtype`): one byte per element and a float32 scale per group
of 32 elements of a (token, kv head), so a head's token takes 1.125 d bytes where bfloat16 takes
2 d (1.78x the blocks in the same memory; 3.56x against float32).

A group's scale is its absmax over the type's largest value, computed as each token's K/V are
written: no calibration. Groups, as llama.cpp's q8_0 cache has them, because keys carry outlier
channels (absmax 7-11x the vector's RMS on the default model): one scale per head vector gives
int8's small channels one or two levels, enough to flip greedy tokens at top-two gaps of 1.3
nats on counting text (docs/quantization.md). Kinds:
- int8: round(x / scale) in [-127, 127];
- fp8 / fp8_e4m3: x / scale as float8 e4m3 (max 448, 3 mantissa bits);
- fp8_e5m2: x / scale as float8 e5m2 (max 57344, 2 mantissa bits).

The cache tensors are uint8 [2, blocks, block_size, hk, d] and float32 scales [2, blocks,
block_size, hk, d / 32]. (A head size not a multiple of 32 takes one scale per head vector.) On
CPU the C kernels write and read them (`pl_kv_cache_write`, and the decode attention, which
scales each loaded vector); on the Triton path (CUDA) its kernels do (triton_ops); elsewhere,
and for the prompt's SDPA path, the torch functions here do, all with the same roundings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import KV_CACHE_DTYPES
from pagedllm.model_executor.custom_op import CustomFn
from pagedllm.model_executor.layers import cpu_kernels


@dataclass(frozen=True, slots=True)
class KVQuant:
    name: str  # the canonical kind: int8, fp8_e4m3 or fp8_e5m2
    kind: int  # csrc/vec.h's KV_* id
    qmax: float  # the largest stored value; a vector's absmax maps onto it
    element: torch.dtype  # what the stored bytes are


_KINDS = {
    "int8": KVQuant("int8", cpu_kernels.KV_INT8, 127.0, torch.int8),
    "fp8_e4m3": KVQuant("fp8_e4m3", cpu_kernels.KV_FP8_E4M3, 448.0, torch.float8_e4m3fn),
    "fp8_e5m2": KVQuant("fp8_e5m2", cpu_kernels.KV_FP8_E5M2, 57344.0, torch.float8_e5m2),
}


def kv_quant_for(cache_dtype: str) -> KVQuant | None:
    """The quantization of a `--kv-cache-dtype` value; None for `auto` (the model's dtype)."""
    if cache_dtype == "auto":
        return None
    name = "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype
    if name not in _KINDS:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {cache_dtype!r}")
    return _KINDS[name]


GROUP = 32  # elements per scale (the C kernels' unit)


def groups_per_head(head_dim: int) -> int:
    """Scales per (token, kv head)."""
    return head_dim // GROUP if head_dim % GROUP == 0 else 1


def bytes_per_token_head(head_dim: int, element_size: int, quant: KVQuant | None) -> int:
    """Bytes of one token's K (or V) for one kv head."""
    return head_dim * element_size if quant is None else head_dim + 4 * groups_per_head(head_dim)


def quantize(x: torch.Tensor, quant: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] → (bytes uint8 [..., d], scales float32 [..., groups]), as pl_kv_cache_write
    stores them."""
    d = x.shape[-1]
    x = x.float().unflatten(-1, (groups_per_head(d), -1))
    scale = x.abs().amax(dim=-1) / quant.qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (x / scale[..., None]).clamp(-quant.qmax, quant.qmax)
    if quant.element == torch.int8:
        y = y.round()
    return y.to(quant.element).view(torch.uint8).flatten(-2), scale


def dequantize(data: torch.Tensor, scales: torch.Tensor, quant: KVQuant, dtype: torch.dtype) -> torch.Tensor:
    """Stored bytes [..., d] and their scales [..., groups] → values in `dtype`."""
    values = data.view(quant.element).float().unflatten(-1, (scales.shape[-1], -1))
    return (values * scales[..., None]).flatten(-2).to(dtype)


def gather(data: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, quant: KVQuant,
           dtype: torch.dtype) -> torch.Tensor:
    """Entries `index` (along dim 0: blocks or slots) of stored bytes and their scales, as values."""
    return dequantize(data.index_select(0, index), scales.index_select(0, index), quant, dtype)


def _write_native(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor,
                  kv_scales: torch.Tensor, quant: KVQuant) -> None:
    hk, d = kv_cache.shape[-2:]
    for i, x in enumerate((k, v)):
        data, scale = quantize(x, quant)
        kv_cache[i].view(-1, hk, d).index_copy_(0, slots, data)
        kv_scales[i].view(-1, hk, scale.shape[-1]).index_copy_(0, slots, scale)


def _write_cpu(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor,
               kv_scales: torch.Tensor, quant: KVQuant) -> None:
    if k.shape[-1] % GROUP or v.dtype != k.dtype:
        return _write_native(k, v, slots, kv_cache, kv_scales, quant)
    cpu_kernels.kv_cache_write(k, v, slots, kv_cache, kv_scales, quant.kind)


# A step's k, v [T, hk, d] into their slots of the byte cache and its scales.
write = CustomFn(_write_native, _write_cpu)


def read_slots(kv_cache: torch.Tensor, kv_scales: torch.Tensor, slots: torch.Tensor, quant: KVQuant,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V the cache holds for `slots`, as values: what every later read of them sees."""
    hk, d = kv_cache.shape[-2:]
    groups = kv_scales.shape[-1]
    return tuple(gather(kv_cache[i].view(-1, hk, d), kv_scales[i].view(-1, hk, groups), slots, quant, dtype)
                 for i in (0, 1))
