"""Quantized weights cached on disk: a warm start reads them (one safetensors file) instead of
quantizing the model again, which takes longer than loading it (the default model: ~170 M
weights of the head twice, ~100 M of the decoder).

One file per checkpoint and everything the result depends on: the weight files (path, size,
modification time), the mode, the activation dtype, the kernel build level, the W8A8 head's
weight range (VNNI or not), the rank's shard and stage, and the quantization code itself. A
file that fails to load is ignored and replaced. `PAGEDLLM_QUANT_CACHE=0` turns it off.

A GGUF file run on its own blocks caches only its LM head's ranking copies (`gguf_head_file`):
the rest of the model is the file itself.

Every new version, quantization mode or converted checkpoint makes a new file (~360 MB for the
default model): a write removes the files no start has read for `STALE_DAYS`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedllm import envs
from pagedllm.cache_files import mark_used, prune_stale, write_atomically
from pagedllm.envs import cache_root
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers import quantization as qz
from pagedllm.transformers_utils.page_cache import in_huge_pages
from pagedllm.version import __version__

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_CODE = (Path(qz.__file__), Path(__file__).with_name("quantize.py"))
_GGUF_HEAD_CODE = (Path(qz.__file__).with_name("gguf_linear.py"), Path(qz.__file__).parents[2] / "csrc" / "gguf.c")
STALE_DAYS = 7


def cache_dir() -> Path:
    return cache_root() / "quantized"


def cache_file(model_path: str, mode: str, dtype: torch.dtype, module_names: list[str], shard: str) -> Path | None:
    """Where this model's quantized weights are cached; None when caching is off or the
    checkpoint has no weight files to key it by."""
    if not envs.PAGEDLLM_QUANT_CACHE or not os.path.isdir(model_path):
        return None
    files = sorted(p for p in Path(model_path).iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    if not files:
        return None
    return _keyed_file(_CODE, str(Path(model_path).resolve()),
                       *(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files),
                       mode, str(dtype), shard, *module_names)


def _keyed_file(code: tuple[Path, ...], *parts: str) -> Path:
    """The cache file for `parts` plus what every entry depends on: the version, the code that
    makes it, the kernel build level and the W8A8 weight range."""
    key = [__version__, *(p.read_text() for p in code), cpu_kernels.loaded_isa() or "torch",
           str(qz.DynamicInt8Quant.weight_qmax()), *parts]
    return cache_dir() / f"{hashlib.sha256(chr(0).join(key).encode()).hexdigest()[:24]}.safetensors"


def gguf_head_file(gguf_path: str, shard: str) -> Path | None:
    """Where a GGUF file's LM-head ranking copies (`GGUFRankedHead`) are cached: keyed by the
    file (path, size, modification time), the code that makes them and the kernel level."""
    if not envs.PAGEDLLM_QUANT_CACHE or not os.path.isfile(gguf_path):
        return None
    st = os.stat(gguf_path)
    return _keyed_file((*_CODE, *_GGUF_HEAD_CODE), "gguf head", os.path.realpath(gguf_path),
                       f"{st.st_size}:{st.st_mtime_ns}", shard)


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, dict]) -> None:
    """Written under a temporary name and renamed: a concurrent reader never sees half a file.
    Then the files no start has read for STALE_DAYS (`load` marks a file read) are removed, and
    temporary files a killed process left a day ago or more."""
    write_atomically(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
                                                 metadata={"modules": json.dumps(meta)}), temp_prefix=".quant-")
    prune_stale(path.parent, "*.safetensors", STALE_DAYS * 86400, temp_prefix=".quant-")


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    from safetensors import safe_open

    mark_used(path)
    with safe_open(str(path), framework="pt") as f:  # one open, one header parse
        return ({name: in_huge_pages(f.get_tensor(name)) for name in f.keys()},
                json.loads(f.metadata()["modules"]))
