"""PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors` (or `.bin`) read and
checked against the base model. `check_adapter` reads only the config and the tensors' headers
(the front end runs it before a request is accepted, so a bad adapter is a clear ValueError and
never reaches the engine); `load_adapter` reads the weights, with each module's scaling
(lora_alpha / r, or / sqrt(r) for rsLoRA; per-module rank_pattern / alpha_pattern) folded in."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

# PEFT's module names → which of pagedllm's fused layers they live in (llama.py, gemma3.py).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(slots=True)
class LoRAWeights:
    """One adapter, ready for the slots: (layer, module) → (A [r, in], B·scaling [out, r])."""

    name: str
    rank: int  # the largest module rank
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def target_shapes(text_config: Any) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each module a LoRA may target, from the HF config."""
    hidden, inter = text_config.hidden_size, text_config.intermediate_size
    heads, kv_heads = text_config.num_attention_heads, getattr(text_config, "num_key_value_heads", None)
    head_dim = getattr(text_config, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, (kv_heads or heads) * head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def _weights_file(path: str) -> str:
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise ValueError(f"LoRA adapter {path!r}: no adapter_model.safetensors (or .bin) in it")


def read_adapter_config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r}: not a directory")
    config_path = os.path.join(path, "adapter_config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {path!r}: no adapter_config.json in it") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is unreadable: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: not a PEFT LoRA (peft_type {config.get('peft_type')!r})")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if config.get(key) == bad:
            raise ValueError(f"LoRA adapter {path!r}: {key}=true is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {path!r}: modules_to_save ({config['modules_to_save']}) is not supported")
    return config


def _headers(file: str) -> dict[str, tuple[int, ...]]:
    if file.endswith(".bin"):
        return {k: tuple(v.shape) for k, v in torch.load(file, map_location="cpu", weights_only=True).items()}
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the first key that names the module (a suffix or a regex)."""
    for key, value in (pattern or {}).items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return value
    return default


def _modules(path: str, shapes: dict[str, tuple[int, ...]], text_config: Any,
             max_rank: int) -> dict[tuple[int, str], dict[str, str]]:
    """(layer, module) → {"A": key, "B": key}, every tensor's shape and rank checked."""
    expected = target_shapes(text_config)
    num_layers = text_config.num_hidden_layers
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key, shape in shapes.items():
        m = _KEY.search(key)
        if m is None:
            what = "embed_tokens / lm_head" if "embed" in key or "lm_head" in key else key
            raise ValueError(f"LoRA adapter {path!r}: targets {what}, which pagedllm's LoRA does not support "
                             f"(supported: {', '.join(TARGET_MODULES)})")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in expected:
            raise ValueError(f"LoRA adapter {path!r}: targets {module!r}, which this model's layers lack "
                             f"(supported: {', '.join(TARGET_MODULES)})")
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {path!r}: has layer {layer}, the model has {num_layers}")
        out, inp = expected[module]
        rank = shape[0] if ab == "A" else shape[1]
        want = (rank, inp) if ab == "A" else (out, rank)
        if len(shape) != 2 or tuple(shape) != want:
            raise ValueError(f"LoRA adapter {path!r}: {key} has shape {tuple(shape)}, the base model needs {want}: "
                             "was it trained for another model?")
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: rank {rank} is above --max-lora-rank {max_rank}")
        found.setdefault((layer, module), {})[ab] = key
    if not found:
        raise ValueError(f"LoRA adapter {path!r}: holds no LoRA weights")
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} lacks lora_{'B' if 'A' in pair else 'A'}")
        if shapes[pair["A"]][0] != shapes[pair["B"]][1]:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module}: lora_A and lora_B ranks differ")
    return found


def check_adapter(path: str, text_config: Any, max_rank: int) -> int:
    """Validate an adapter without reading its weights; returns its (largest) rank."""
    read_adapter_config(path)
    shapes = _headers(_weights_file(path))
    return max(shapes[p["A"]][0] for p in _modules(path, shapes, text_config, max_rank).values())


def load_adapter(path: str, name: str, text_config: Any, max_rank: int, dtype: torch.dtype) -> LoRAWeights:
    config = read_adapter_config(path)
    file = _weights_file(path)
    if file.endswith(".bin"):
        tensors = torch.load(file, map_location="cpu", weights_only=True)
    else:
        from safetensors.torch import load_file

        tensors = load_file(file)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    modules = {}
    for (layer, module), pair in _modules(path, shapes, text_config, max_rank).items():
        a, b = tensors[pair["A"]].float(), tensors[pair["B"]].float()
        full = f"model.layers.{layer}.{module}"
        rank = _pattern_value(config.get("rank_pattern"), full, config.get("r", a.shape[0]))
        alpha = _pattern_value(config.get("alpha_pattern"), full, config.get("lora_alpha", rank))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[(layer, module)] = (a.to(dtype), (b * scaling).to(dtype))
    return LoRAWeights(name, max(a.shape[0] for a, _ in modules.values()), modules)
