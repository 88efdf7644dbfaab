"""Linear weights pre-packed for oneDNN, the CPU GEMM that every linear and the LM head use.

`F.linear` on CPU hands oneDNN a plain [out, in] weight, which it re-lays-out into its
blocked format on every call. Doing that once after loading (`torch.ops.mkldnn`'s
reorder + `_linear_pointwise`, the same pair inductor's CPU freezing pass emits) gives
bit-identical bf16 results and, on the AVX-512 bf16 CPU we measure on, 2x faster batch-1
linears and a 1.5x faster batch-1 LM head (numbers in docs/performance.md).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Rows the packing is tuned for; other row counts run the same packed weight.
_BATCH_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN copy of a [out, in] weight, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.no_grad()
def pack_model(model: nn.Module) -> None:
    """Give every `Linear` and `LMHead` of a loaded (and quantized) CPU model a packed weight.

    A linear's dense weight is released: after loading nothing reads it. The LM head's dense
    weight stays, since it is the embedding when tied and the quantized head's reference; a
    quantized head needs no packed float copy.
    """
    from pagedllm.model_executor.layers.linear import Linear
    from pagedllm.model_executor.layers.vocab_embedding import LMHead

    nbytes = 0
    for module in model.modules():
        if isinstance(module, Linear) and can_pack(module.weight):
            module.packed = pack_weight(module.weight)
            nbytes += module.weight.numel() * module.weight.element_size()
            module.weight.data = module.weight.data.new_empty(0)
        elif isinstance(module, LMHead) and module.quant is None:
            weight = module.tied_to.weight if module.tied_to is not None else module.weight
            if can_pack(weight):
                module.packed = pack_weight(weight)
                nbytes += weight.numel() * weight.element_size()
    if nbytes:
        logger.info("packed %.0f MB of linear weights for oneDNN", nbytes / 1e6)
