"""Give a loaded model's linears and LM head quantized int8 / int4 copies (`--quantization`).

Done after loading, from the float weights, so every checkpoint format gets it. A GGUF file's
blocks were dequantized on conversion; they are re-quantized here into the formats the CPU
kernels take, not run in their own block formats.

What each mode quantizes, and why (measurements in docs/performance.md):
- Decoder linears are int8 in both modes. int4 there would save ~3.5 ms/token at batch 1 on
  Gemma 3 270M but costs 2-5% perplexity per kind of layer (+15% for all of them); int8
  costs none.
- The LM head (63% of the FLOPs) is W8A8 (`DynamicInt8Quant`) at every batch size in both
  modes: one path for all rows keeps a request's logits independent of its batch. int4 adds an
  int4 weight-only copy for up to 8 rows (batch-1 decode streams half the bytes), and then
  both copies only rank the vocabulary: each row's top candidates are recomputed from the
  float weight (`QuantizedLMHead`), so greedy picks agree whichever copy ranked them.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import DynamicInt8Quant, QuantizedLMHead, quantize_weight
from pagedllm.model_executor.layers.vocab_embedding import LMHead

logger = logging.getLogger(__name__)

# mode -> (format of the decoder linears, weight-only head copy for few rows, top-k recomputed)
FORMATS = {"int8": ("int8", None, 0), "int4": ("int8", "int4", 256)}
# Rows up to which a weight-only kernel beats the alternative on the target CPU, with weights
# streamed from memory as in a real forward pass: packed bf16 for the decoder linears, W8A8 for
# the head (benchmarks/bench_linear_kernels.py).
MAX_ROWS = {("linear", "int8"): 4, ("lm_head", "int4"): 8}


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str) -> None:
    """Attach quantized copies to every `Linear` and `LMHead` of `model`, in place.

    A linear's float weight is overwritten with its dequantized values: the float path (many
    rows) and the kernel (few rows) then compute the same model. The head keeps its float
    weight as it is (for a tied head that is the embedding, which must not change), since
    it is the reference the top candidates are recomputed from.
    """
    linear_format, head_format, top_k = FORMATS[mode]
    nbytes = 0
    for module in [m for m in model.modules() if isinstance(m, (Linear, LMHead))]:
        if isinstance(module, Linear):
            module.quant = quantize_weight(module.weight.data, linear_format, MAX_ROWS["linear", linear_format])
            nbytes += _nbytes(module.quant)
        else:
            weight = module.tied_to.weight if module.tied_to is not None else module.weight
            dynamic = DynamicInt8Quant(weight.data)
            few_rows = None
            if head_format is not None:
                few_rows = quantize_weight(weight.data, head_format, MAX_ROWS["lm_head", head_format], write_back=False)
                nbytes += _nbytes(few_rows)
            module.quant = QuantizedLMHead(dynamic, few_rows, top_k)
            nbytes += dynamic.nbytes
    logger.debug("quantized (%s): %.0f MB of quantized weights", mode, nbytes / 1e6)


def _nbytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())
