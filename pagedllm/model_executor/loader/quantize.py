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
from pathlib import Path

import torch
from torch import nn

from pagedllm import cpu_isa
from pagedllm.cpu_malloc import release_freed_memory
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers.cpu_gemm import onednn_has_bf16
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import (
    DynamicInt8Quant,
    QuantizedLMHead,
    WeightOnlyQuant,
    dequantize_int8,
    quantize_weight,
)
from pagedllm.model_executor.layers.vocab_embedding import LMHead, VocabEmbedding
from pagedllm.model_executor.loader import quant_cache

logger = logging.getLogger(__name__)

# mode -> (format of the decoder linears, weight-only head copy for few rows, top-k recomputed)
FORMATS = {"int8": ("int8", None, 0), "int4": ("int8", "int4", 256)}


def linear_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which a decoder linear runs the int8 kernel rather than its float weight, with
    weights streamed from memory as in a forward pass (benchmarks/bench_linear_kernels.py).
    Against oneDNN's packed bf16 GEMM (AVX-512 bf16): 4. Against float32 (CPUs without native
    bf16, or a float32 model), twice the bytes: 128 on the AVX2 build, where oneDNN's float32
    GEMM is slower still: the default model's batch-64 decode step took 405 ms against 433 with
    a 32-row limit, batch 128 731 against 755 (the two limits alternated in one process); 256
    rows gained nothing. 32 on the other builds, not measured at more rows."""
    if dtype == torch.bfloat16 and onednn_has_bf16():
        return 4
    return 128 if cpu_kernels.loaded_isa() == "avx2" else 32


def head_int4_max_rows() -> int:
    """Rows up to which the LM head runs its int4 copy rather than its int8 one: 8 against
    oneDNN's W8A8 GEMM with VNNI. Without VNNI the int8 copy runs the C kernel, behind at 6
    rows and ahead at 8 (7 not measured): the default model's GGUF head (262,144 x 640) on a
    2-vCPU AVX2 EPYC, each copy's ranking alone, two rounds, 2026-12-01: 5 rows 8.4-8.8 ms
    (int4) against 10.1-10.4 (int8), 6 rows 9.3-9.7 against 10.3, 8 rows 12.3-12.5 against
    10.3-10.4."""
    return 8 if cpu_isa.has_vnni() else 6


@torch.no_grad()
def restore_quantized(model: nn.Module, mode: str, cache: Path) -> bool:
    """Attach the quantized copies `quantize_model` saved in `cache`, before the checkpoint is
    read: each linear's float weight gets its dequantized values here and is marked `preloaded`,
    so loading skips its checkpoint tensor. False where the cache is missing or does not fit
    (no quantized copy stays attached, no weight is marked; the caller then loads every weight,
    over any a partial restore wrote, and quantizes)."""
    if not cache.exists():
        return False
    modules = _quantizable(model)
    try:
        tensors, meta = quant_cache.load(cache)
        _restore(modules, mode, tensors, meta)
    except Exception as e:  # noqa: BLE001 - whatever is wrong with a cache file, quantizing again fixes it
        logger.warning("ignoring the quantization cache %s: %s", cache, e)
        for _, module in modules:
            module.quant = None
        return False
    for _, module in modules:
        if isinstance(module, Linear):
            module.weight.preloaded = True
    logger.info("Quantized weights (%s) read from %s", mode, cache)
    return True


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, cache: Path | None = None) -> None:
    """Attach quantized copies to every `Linear` and `LMHead` of the loaded `model`, in place,
    and save them to `cache` (quant_cache.py) when given.

    A linear's float weight is overwritten with its dequantized values: the float path (many
    rows) and the kernel (few rows) then compute the same model. The head keeps its float
    weight as it is (for a tied head that is the embedding, which must not change), since
    it is the reference the top candidates are recomputed from.
    """
    modules = _quantizable(model)
    linear_format, head_format, top_k = FORMATS[mode]
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, dict] = {}
    for name, module in modules:
        if isinstance(module, Linear):
            module.quant = quantize_weight(module.weight.data, linear_format, linear_max_rows(module.weight.dtype))
            meta[name] = _describe(module.quant, tensors, name)
        else:
            weight = _head_weight(module)
            dynamic = DynamicInt8Quant(weight.data)
            tensors[f"{name}.dynamic.qweight"], tensors[f"{name}.dynamic.scale"] = dynamic.int8_weight()
            few_rows = _few_rows(weight, head_format)
            module.quant = QuantizedLMHead(dynamic, few_rows, top_k)
            meta[name] = {"top_k": top_k, "few_rows": few_rows and _describe(few_rows, tensors, f"{name}.few_rows")}
    if cache is not None:
        try:
            quant_cache.save(cache, tensors, meta)
        except OSError as e:
            logger.warning("could not write the quantization cache %s: %s", cache, e)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    logger.debug("quantized (%s): %.0f MB of quantized weights", mode, nbytes / 1e6)


def keep_heads_in_file_dtype(model: nn.Module) -> None:
    """Before a pre-quantized checkpoint is read on CPU: its float LM head and embedding will
    only be looked up and re-scored by rows (`rank_float_heads`), so they stay in the file's
    dtype (mapped where the file allows) rather than copied into a float32 model's (1 GB for
    Llama-3.2-1B's table)."""
    if cpu_kernels.kernels() is None:
        return
    for module in model.modules():
        if isinstance(module, (VocabEmbedding, LMHead)) and getattr(module, "gguf", None) is None:
            module.keep_file_dtype = True


@torch.no_grad()
def rank_float_heads(model: nn.Module) -> None:
    """A pre-quantized checkpoint's float LM head (GPTQ, AWQ, FP8 and llm-compressor leave it
    out) gets the ranking copies `--quantization int4` gives one, in place of oneDNN's packed
    float copy: int4 for few rows and W8A8 for many, each row's top candidates re-scored from
    the float weight, and the rows whose logprobs go back to a user computed from it whole.
    For Llama-3.2-1B's tied 128,256 x 2,048 head that is 0.4 GB of copies, against a 1.05 GB
    float32 packed copy beside a 1.05 GB float32 table; greedy picks are the float head's."""
    if cpu_kernels.kernels() is None:
        return
    _, head_format, top_k = FORMATS["int4"]
    for module in model.modules():
        if isinstance(module, LMHead) and module.quant is None and module.gguf is None:
            weight = _head_weight(module)
            dynamic = DynamicInt8Quant(weight.data)
            dynamic.int8_weight()  # where oneDNN's packed copy runs, the int8 one goes before the int4 one is made
            release_freed_memory()  # with it: 0.1-0.4 GB off the load's peak at 1B
            module.quant = QuantizedLMHead(dynamic, _few_rows(weight, head_format), top_k, exact_rows=True)


def _head_weight(module: LMHead) -> torch.Tensor:
    return module.tied_to.weight if module.tied_to is not None else module.weight


def _few_rows(weight: torch.Tensor, head_format: str | None) -> WeightOnlyQuant | None:
    """The head's copy for few rows (int4 under `--quantization int4`)."""
    if head_format is None:
        return None
    return quantize_weight(weight.data, head_format, head_int4_max_rows(), write_back=False)


def _quantizable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, (Linear, LMHead)) and getattr(m, "gguf", None) is None]


def _describe(quant: WeightOnlyQuant, tensors: dict[str, torch.Tensor], name: str) -> dict:
    tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = quant.qweight, quant.scales
    return {"method": quant.method, "in_features": quant.in_features, "group_size": quant.group_size,
            "layout": quant.layout}


def _rebuild(tensors: dict[str, torch.Tensor], name: str, info: dict, max_rows: int) -> WeightOnlyQuant:
    """The row limit is not cached: it is this process's choice (`linear_max_rows`,
    `head_int4_max_rows`), which follows measurements that may change while the weights do
    not (the kernels' level is part of the cache key; oneDNN's native bf16 is not)."""
    return WeightOnlyQuant(info["method"], tensors[f"{name}.qweight"], tensors[f"{name}.scales"], info["in_features"],
                           info["group_size"], max_rows, info["layout"])


def _restore(modules: list[tuple[str, nn.Module]], mode: str, tensors: dict[str, torch.Tensor],
             meta: dict[str, dict]) -> None:
    """What `quantize_model` computed, from its cached tensors, the linears' written-back
    weights included (the same dequantization of the same int8 values)."""
    if {name for name, _ in modules} != set(meta):
        raise KeyError("the cached modules are not this model's")
    for name, module in modules:
        info = meta[name]
        if isinstance(module, Linear):
            quant = _rebuild(tensors, name, info, linear_max_rows(module.weight.dtype))
            k = module.weight.shape[1]
            if quant.method != "int8" or quant.out_features != module.weight.shape[0] or info["in_features"] != k:
                raise ValueError(f"{name}: cached {quant.method} {tuple(quant.qweight.shape)}")
            module.weight.data.copy_(dequantize_int8(quant.qweight[:, :k], quant.scales))
            module.quant = quant
        else:
            dynamic = DynamicInt8Quant(None, (tensors[f"{name}.dynamic.qweight"], tensors[f"{name}.dynamic.scale"]))
            dynamic.int8_weight()  # not kept: the packed copy is what runs
            few = info["few_rows"] and _rebuild(tensors, f"{name}.few_rows", info["few_rows"], head_int4_max_rows())
            module.quant = QuantizedLMHead(dynamic, few or None, info["top_k"])
