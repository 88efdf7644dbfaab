"""Linear weights pre-packed for oneDNN, the CPU GEMM that every linear and the LM head use.

`F.linear` on CPU hands oneDNN a plain [out, in] weight, which it re-lays-out into its
blocked format on every call. Doing that once after loading (`torch.ops.mkldnn`'s
reorder + `_linear_pointwise`, the same pair inductor's CPU freezing pass emits) gives
bit-identical bf16 results and, on the AVX-512 bf16 CPU we measure on, 2x faster batch-1
linears and a 1.5x faster batch-1 LM head (numbers in docs/performance.md).
"""

from __future__ import annotations

import torch

from pagedllm import cpu_isa

# Rows the packing is tuned for; other row counts run the same packed weight.
_BATCH_HINT = 64


def onednn_has_bf16() -> bool:
    """Whether oneDNN runs bf16 on this CPU (AVX-512 and up); elsewhere its bf16 GEMMs, and its
    int8 GEMMs with bf16 output, are reference loops, 100-1000x slower. Not under
    PAGEDLLM_CPU_ISA=avx2, even if torch ran before the cap could reach oneDNN."""
    available = torch.backends.mkldnn.is_available()
    return available and torch.ops.mkldnn._is_mkldnn_bf16_supported() and not cpu_isa.capped()


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN takes this weight packed: float32 always, bf16 where it runs bf16."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and onednn_has_bf16())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN copy of a [out, in] weight, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
