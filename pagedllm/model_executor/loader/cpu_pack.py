"""After loading (and quantizing): give a CPU model's linears and LM head their oneDNN-packed
weights (`layers/cpu_gemm.py`)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.model_executor.layers.cpu_gemm import can_pack, pack_weight
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.vocab_embedding import LMHead

logger = logging.getLogger(__name__)


@torch.no_grad()
def pack_model(model: nn.Module) -> None:
    """Give every `Linear` and `LMHead` of a loaded (and quantized) CPU model a packed weight.

    A linear's dense weight is released: after loading nothing reads it. The LM head's dense
    weight stays, since it is the embedding when tied and the quantized head's reference; a
    quantized head needs no packed float copy.
    """
    nbytes = 0
    for module in model.modules():
        if getattr(module, "gguf", None) is not None:  # runs the file's blocks
            continue
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
        logger.debug("packed %.0f MB of linear weights for oneDNN", nbytes / 1e6)
