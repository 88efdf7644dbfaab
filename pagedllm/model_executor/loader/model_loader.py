"""Build the model for a config and fill it from the checkpoint."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedllm import envs
from pagedllm.config import ModelConfig, check_quantization
from pagedllm.cpu_malloc import PeriodicRelease, release_freed_memory
from pagedllm.model_executor.layers.gguf_linear import GGUFLinear, GGUFRankedHead
from pagedllm.model_executor.layers.vocab_embedding import LMHead, VocabEmbedding
from pagedllm.model_executor.loader.cpu_pack import pack_model
from pagedllm.model_executor.models.registry import resolve_model_cls
from pagedllm.model_executor.models.utils import building_in
from pagedllm.transformers_utils.page_cache import anonymous_zeros, huge_pages_on
from pagedllm.transformers_utils.quant_config import read_quant_format
from pagedllm.transformers_utils.quantized_checkpoint import iterate_quantized
from pagedllm.transformers_utils.weight_utils import iterate_weights

logger = logging.getLogger(__name__)

RELEASE_EVERY = 64 << 20  # bytes loaded (or repacked) between hand-backs of the heap's free memory


def get_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    check_quantization(model_config.quantization, device)  # before building: its kernels are CPU ones
    model_cls = resolve_model_cls(model_config.architecture)
    start = time.perf_counter()
    with building_in(model_config.dtype, device):
        # The engine's context length, for the models whose rotary tables depend on it (LongRoPE).
        takes_len = "max_model_len" in inspect.signature(model_cls).parameters
        kwargs = {"max_model_len": model_config.max_model_len} if takes_len else {}
        # A vision-language model takes the whole config (its vision tower's too).
        config = model_config.hf_config if getattr(model_cls, "supports_multimodal", False) else \
            model_config.text_config
        model = model_cls(config, **kwargs)
    restored = False
    cache = _quant_cache_file(model, model_config)
    if cache is not None:  # the linears' float weights come with their quantized copies, unread
        from pagedllm.model_executor.loader.quantize import restore_quantized

        restored = restore_quantized(model, model_config.quantization, cache)
    # A pre-quantized checkpoint's format (None for float weights and GGUF files)
    fmt = read_quant_format(model_config.hf_config) if model_config.quantization else None
    native = model_config.quantization == "gguf" or fmt is not None
    rank_head = fmt is not None and device.type == "cpu" and envs.PAGEDLLM_RANK_FLOAT_HEAD
    if rank_head:
        from pagedllm.model_executor.loader.quantize import keep_heads_in_file_dtype

        keep_heads_in_file_dtype(model)
    if model_config.load_format == "dummy":
        init_dummy_weights(model)
    else:
        weights = iterate_weights(model_config.model_path, model_config.load_format, model_config.hf_config,
                                  gguf_native=native)
        if fmt is not None:
            weights = iterate_quantized(weights, fmt)
        model.load_weights(_releasing(weights))
    for param in model.parameters():
        param.__dict__.pop("preloaded", None)
    if model_config.quantization == "fp8" and fmt is None:
        from pagedllm.model_executor.loader.fp8 import quantize_fp8_linears

        quantize_fp8_linears(model)
    if native or model_config.quantization == "fp8":
        _finish_gguf(model, model_config, device)
    elif model_config.quantization and not restored:
        from pagedllm.model_executor.loader.quantize import quantize_model

        quantize_model(model, model_config.quantization, cache)
    if rank_head:
        from pagedllm.model_executor.loader.quantize import rank_float_heads

        release_freed_memory()  # the load's temporaries go before the head's copies are made
        rank_float_heads(model)
    pack_model(model)
    release_freed_memory()  # the load's temporaries: hundreds of MB
    logger.info("Weights: %s loaded from %s (%s, quantization %s) in %.1f s", model_config.architecture,
                model_config.model_path, str(model_config.dtype).removeprefix("torch."),
                model_config.quantization or "none", time.perf_counter() - start)
    return model.eval().requires_grad_(False)


def _releasing(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors as they come, the heap's free memory handed back to the OS each
    `RELEASE_EVERY` bytes loaded: a worker keeps its freed memory for its steps (`cpu_malloc`),
    so a load's temporaries (a quantized module's parts and their repack) would otherwise stay
    resident to its end (1.1 GiB at the end of a 1B FP8 checkpoint's load)."""
    release = PeriodicRelease(RELEASE_EVERY)
    for name, tensor in weights:
        yield name, tensor  # loaded by the consumer before it asks for the next
        shape, dtype = getattr(tensor, "shape", None), getattr(tensor, "dtype", None)
        release.add(shape.numel() * dtype.itemsize if shape is not None and dtype is not None else 0)


def _finish_gguf(model: nn.Module, model_config: ModelConfig, device: torch.device) -> None:
    """After loading the file's blocks: a tied LM head multiplies by the embedding's blocks, the
    float weights the layers were built with (never written, so never paged in) go, and on the
    CPU the linears' Q4_K / Q6_K / Q5_0 / Q4_0 blocks are repacked for decode (`GGUFLinear.repack`; not the
    embedding and head, which are also read a row at a time)."""
    linears = []
    for name, module in model.named_modules():
        if isinstance(module, LMHead) and module.gguf is None and module.tied_to is not None:
            module.gguf = module.tied_to.gguf
        gguf = getattr(module, "gguf", None)
        if gguf is None:
            continue
        gaps = gguf.uncovered()
        if gaps and not isinstance(module, (VocabEmbedding, LMHead)):  # a vocabulary's padding rows may stay empty
            raise ValueError(f"{name}: the GGUF file leaves output rows {gaps} of its weight unloaded")
        weight = getattr(module, "weight", None)
        if weight is not None:
            weight.data = weight.data.new_empty((0, weight.shape[-1]))
        if isinstance(module, LMHead) and isinstance(gguf, GGUFLinear) and not gaps:
            module.gguf = _ranked_head(gguf, model_config) or gguf
        elif isinstance(gguf, GGUFLinear) and not isinstance(module, (VocabEmbedding, LMHead)):
            linears.append(gguf)
    if device.type == "cpu" and envs.PAGEDLLM_GGUF_REPACK:
        _repack(linears)


def _repack(linears: list[GGUFLinear]) -> None:
    """The linears' Q4_K / Q6_K / Q5_0 / Q4_0 segments repacked into one huge-page arena (a mapping per tensor
    would leave up to a 2 MiB page's tail resident and unused for each of hundreds of them)."""
    start = time.perf_counter()
    sizes = [-(-rows * cols // 64) * 64 for gguf in linears for _, (rows, cols) in gguf.repackable()]
    if not sizes:
        return
    arena, at = anonymous_zeros((sum(sizes),), torch.uint8, huge_pages=huge_pages_on()), 0

    def alloc(shape: tuple[int, int]) -> torch.Tensor:
        nonlocal at
        out = arena[at : at + shape[0] * shape[1]].view(shape)
        at += -(-out.numel() // 64) * 64
        return out

    repacked, release = 0, PeriodicRelease(RELEASE_EVERY)
    for gguf in linears:  # each linear's old blocks freed as it goes: handed back, not kept to the end
        done = gguf.repack(alloc)
        repacked += done
        release.add(done)
    logger.info("GGUF: %.2f GB of Q4_K / Q6_K / Q5_0 / Q4_0 weights repacked for decode in %.1f s", repacked / 1e9,
                time.perf_counter() - start)


def _ranked_head(blocks: GGUFLinear, model_config: ModelConfig) -> GGUFRankedHead | None:
    """The GGUF LM head's ranking copies, read from the quantized-weight cache where a start
    wrote them for this file, else made (and cached)."""
    from pagedllm.distributed import get_tp_group
    from pagedllm.model_executor.loader import quant_cache
    from pagedllm.model_executor.loader.quantize import head_int4_max_rows
    from pagedllm.transformers_utils.gguf_weights import gguf_source

    max_rows, source = head_int4_max_rows(), gguf_source(model_config.model_path)
    tp = get_tp_group()
    path = None if source is None else quant_cache.gguf_head_file(
        source["source"], f"head {max_rows} tp {tp.rank_in_group}/{tp.world_size}")
    if path is not None and path.is_file():
        try:
            return GGUFRankedHead.build(blocks, max_rows, saved=quant_cache.load(path)[0])
        except Exception:  # unreadable, or made for another shape: made again and rewritten
            logger.warning("the LM head's cached ranking copies %s cannot be used; making them again", path,
                           exc_info=True)

    def save(tensors: dict[str, torch.Tensor]) -> None:
        try:
            quant_cache.save(path, tensors, {})
        except OSError as e:  # a read-only cache: the next start makes them again
            logger.warning("could not write the quantization cache %s: %s", path, e)

    return GGUFRankedHead.build(blocks, max_rows, save=None if path is None else save)


def _quant_cache_file(model: nn.Module, model_config: ModelConfig) -> Path | None:
    """Where this rank's quantized weights are cached; None without quantization or weights."""
    if model_config.quantization not in ("int8", "int4") or model_config.load_format == "dummy":
        return None
    from pagedllm.distributed import get_tp_group
    from pagedllm.model_executor.loader import quant_cache

    tp = get_tp_group()
    shard = f"{model_config.load_format} tp {tp.rank_in_group}/{tp.world_size}"
    names = [name for name, _ in model.named_modules()]
    return quant_cache.cache_file(model_config.model_path, model_config.quantization, model_config.dtype, names, shard)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3) -> None:
    """--load-format dummy: small random values in every parameter (as vLLM's), seeded, so a model
    can be profiled without reading its checkpoint. Each tensor is drawn where it lives, from a
    generator seeded 0 on its device: an 8B model on a GPU fills in seconds, never passing through
    host memory. On CPU the draw is in float32, then rounded to the parameter's dtype."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(0)
        if param.device.type != "cpu" and param.dtype.is_floating_point:  # in place: no float32 temporary
            param.data.uniform_(low, high, generator=gen)
            continue
        values = torch.empty(param.shape, dtype=torch.float32, device=param.device).uniform_(low, high, generator=gen)
        param.data.copy_(values.to(param.dtype))
