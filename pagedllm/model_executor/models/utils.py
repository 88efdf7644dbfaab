"""Routing checkpoint tensors to parameters, each through its own weight_loader."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import default_weight_loader

# checkpoint sub-module → (stacked parameter's module, shard id)
PACKED_MODULES: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy checkpoint tensors into the model; every parameter must be covered."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name.startswith("lm_head.") and "lm_head.weight" not in params:
            continue  # tied embeddings: the checkpoint may still carry a copy
        parts = name.split(".")
        shard_id = None
        if len(parts) >= 2 and parts[-2] in packed:
            target, shard_id = packed[parts[-2]]
            parts[-2] = target
        pname = ".".join(parts)
        param = params.get(pname)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        tensor = tensor.to(param.dtype)
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded.add(pname)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
    return loaded
