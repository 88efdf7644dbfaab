"""Online FP8 (`--quantization fp8`): a float checkpoint's linears quantized to float8 e4m3 at
load, with a float32 scale per output channel, then run as an FP8 checkpoint's are: int8 blocks
with power-of-two scales on the GGUF kernels (`int_blocks.float_blocks`), the channel scale a
factor on the outputs. vLLM's online FP8 takes one scale per tensor; one per channel costs
nothing here and keeps rows with small weights as precise as the rest. As in vLLM, the LM head
and the embedding stay in the model's dtype."""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import quantize_fp8
from pagedllm.transformers_utils.int_blocks import BLOCK
from pagedllm.transformers_utils.quant_config import QuantFormat
from pagedllm.transformers_utils.quantized_checkpoint import repack

logger = logging.getLogger(__name__)
_FP8 = QuantFormat("fp8", 8, -1, storage="float8")


@torch.no_grad()
def quantize_fp8_linears(model: nn.Module) -> None:
    """Replace each `Linear`'s float weight with its FP8 blocks, one layer at a time (a layer's
    float32 temporaries at most). A linear whose inputs are not whole blocks of 32 stays float."""
    count, kept = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.gguf is not None or module.weight.dim() != 2:
            continue
        if module.weight.shape[1] % BLOCK or module.weight.numel() == 0:
            kept.append(name)
            continue
        q, scale = quantize_fp8(module.weight.data)
        blocks = repack(_FP8, name, {"weight": q.view(torch.uint8).numpy(), "weight_scale": scale.numpy()})
        module._add_gguf(blocks, 0)
        module.weight.data = module.weight.data.new_empty((0, module.weight.shape[1]))
        count += 1
    if kept:
        logger.warning("fp8: %d linears keep float weights (inputs not a multiple of %d): %s", len(kept), BLOCK,
                       ", ".join(kept[:8]))
    logger.info("fp8: %d linears quantized to float8 e4m3 (a scale per output channel)", count)
