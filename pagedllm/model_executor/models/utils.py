"""Routing checkpoint tensors to parameters, each through its own weight_loader; and what the
models share for pipeline parallelism (a stage builds only its layers)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.distributed import get_pp_group, get_pp_indices
from pagedllm.model_executor.layers.linear import default_weight_loader
from pagedllm.transformers_utils.checkpoint_tensor import CheckpointTensor


@dataclass(slots=True)
class IntermediateTensors:
    """What one pipeline stage hands the next: the hidden states after its last layer."""

    hidden_states: torch.Tensor


class PPMissingLayer(nn.Identity):
    """A module another pipeline stage holds: no weights here."""


def make_layers(num_layers: int, build: Callable[[int], nn.Module]) -> tuple[int, int, nn.ModuleList]:
    """This stage's layers [start, end), built; the others are PPMissingLayer, so every layer keeps
    its index (and its checkpoint name)."""
    pp = get_pp_group()
    start, end = get_pp_indices(num_layers, pp.rank_in_group, pp.world_size)
    layers = nn.ModuleList(build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers))
    return start, end, layers


def on_stage(first: bool, build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` if this is the first (or last) stage as asked, else a PPMissingLayer."""
    pp = get_pp_group()
    return build() if (pp.is_first_rank if first else pp.is_last_rank) else PPMissingLayer()


def _missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    return tuple(name + "." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))

# checkpoint sub-module → (stacked parameter's module, shard id)
PACKED_MODULES: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def split_fused(
    weights: Iterable[tuple[str, torch.Tensor]], fused: dict[str, tuple[tuple[str, ...], tuple[int, ...]]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with each fused one (sub-module name → its parts' names and row counts,
    e.g. "qkv_proj" → q/k/v) cut into its parts, renamed as if stored apart: each part then goes
    through PACKED_MODULES to its shard's loader, which takes the rank's slice of it as usual. A
    CheckpointTensor is cut unread, so a rank reads only its rows."""
    for name, tensor in weights:
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in fused:
            yield name, tensor
            continue
        names, sizes = fused[parts[-2]]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {' + '.join(map(str, sizes))}")
        start = 0
        for part, size in zip(names, sizes):
            rows = tensor.rows(start, size) if isinstance(tensor, CheckpointTensor) else tensor[start : start + size]
            yield ".".join(parts[:-2] + [part, parts[-1]]), rows
            start += size


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 route: Callable[[str], tuple[str, tuple] | None] | None = None) -> set[str]:
    """Copy checkpoint tensors into the model; every parameter must be covered. `route(name)`, when
    given, may name the parameter a tensor goes to and its loader's extra arguments (experts)
    before the packed-module mapping is tried."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    elsewhere = _missing_prefixes(model)  # modules of other pipeline stages
    # The embedding and the LM head a tied model shares (names differ per architecture).
    embed_name, head_name = getattr(model, "tied_weight_names", ("model.embed_tokens.weight", "lm_head.weight"))
    head_prefix = head_name.rsplit(".", 1)[0] + "."
    # Tied embeddings on a last stage without the embedding: the LM head owns a copy of it.
    tied_copy = getattr(model.config, "tie_word_embeddings", False) and head_name in params
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if tied_copy and name == embed_name:
            params[head_name].weight_loader(params[head_name], tensor)
            loaded.add(head_name)
        if name.startswith(head_prefix) and (head_name not in params or tied_copy):
            continue  # tied embeddings: the checkpoint may still carry a copy
        if name.startswith(elsewhere):
            continue
        routed = route(name) if route is not None else None
        if routed is not None:
            pname, args = routed
        else:
            parts = name.split(".")
            args = ()
            if len(parts) >= 2 and parts[-2] in packed:
                target, shard_id = packed[parts[-2]]
                parts[-2], args = target, (shard_id,)
            pname = ".".join(parts)
        param = params.get(pname)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        if not getattr(param, "preloaded", False):  # filled already (the quantization cache): not read
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, *args)
        loaded.add(pname)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
    return loaded
