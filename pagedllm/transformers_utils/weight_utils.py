"""Iterate (name, tensor) pairs from an HF checkpoint directory."""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from pagedllm import envs
from pagedllm.transformers_utils.checkpoint_tensor import CheckpointTensor


def safetensors_files(model_dir: str) -> list[str]:
    """The shards named by model.safetensors.index.json, else every *.safetensors file."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {model_dir!r}")
    return files


def pt_files(model_dir: str) -> list[str]:
    """PyTorch checkpoint shards: those pytorch_model.bin.index.json names, else every *.bin / *.pt file."""
    index = os.path.join(model_dir, "pytorch_model.bin.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_dir, "*.bin")) + glob.glob(os.path.join(model_dir, "*.pt")))
    files = [f for f in files if not os.path.basename(f).startswith(("training_args", "optimizer"))]
    if not files:
        raise ValueError(f"no PyTorch (*.bin, *.pt) weights found in {model_dir!r}")
    return files


def iterate_weights(model_dir: str, load_format: str = "auto", config: Any = None,
                    gguf_native: bool = False) -> Iterator[tuple[str, CheckpointTensor | torch.Tensor]]:
    """The checkpoint's tensors by load format: a GGUF file's directory reads the file itself
    (`gguf_weights`; `gguf_native`: quantized tensors offered as their blocks; `config` names
    them); otherwise safetensors (auto: when there are any), else PyTorch .bin / .pt files,
    loaded with weights_only (no code runs) and memory-mapped."""
    if os.path.isfile(os.path.join(model_dir, "gguf_source.json")):
        from pagedllm.transformers_utils.gguf_weights import iterate_gguf_weights

        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_dir)
        yield from iterate_gguf_weights(model_dir, config, gguf_native)
        return
    use_pt = load_format == "pt" or (load_format == "auto" and not safetensors_present(model_dir))
    if not use_pt:
        yield from iterate_checkpoint(model_dir)
        return
    for path in pt_files(model_dir):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()
        del state


def safetensors_present(model_dir: str) -> bool:
    return bool(glob.glob(os.path.join(model_dir, "*.safetensors")))


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One whole tensor at a time, in private memory (see `iterate_checkpoint`); a GGUF file's
    directory gives its tensors dequantized."""
    for name, tensor in iterate_weights(model_dir):
        yield name, tensor.load() if isinstance(tensor, CheckpointTensor) else tensor


def iterate_checkpoint(model_dir: str) -> Iterator[tuple[str, CheckpointTensor]]:
    """One tensor at a time, read only when the consumer asks, and only the part it asks for
    (a tensor-parallel rank reads its slice), into private memory freed once it is copied into
    its parameter. (safe_open memory-maps the file, and the mapped pages stay in the process's
    resident set until the file is closed: ~1 GB more at the peak for a 270M model stored in
    float32.) safe_open still parses and checks the header. A tensor is valid until the next."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
        header, data_start = _read_header(path)
        mappable = never_rewritten(path)
        with open(path, "rb") as raw:
            for name in names:
                yield name, CheckpointTensor(raw, header[name], data_start, mappable)


def never_rewritten(path: str) -> bool:
    """Whether a weight file lives where files are only ever replaced whole (written under
    another name, then renamed): pagedllm's cache and the Hugging Face hub cache's blobs."""
    from huggingface_hub.constants import HF_HUB_CACHE

    real = os.path.realpath(path)
    return any(real.startswith(os.path.realpath(root) + os.sep) for root in (envs.cache_root(), HF_HUB_CACHE))


def _read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size
