"""Routing checkpoint tensors to parameters, each through its own weight_loader; and what the
models share for pipeline parallelism (a stage builds only its layers)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.distributed import get_pp_group, get_pp_indices
from pagedllm.model_executor.layers.linear import default_weight_loader
from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead
from pagedllm.transformers_utils.checkpoint_tensor import CheckpointTensor


@contextmanager
def building_in(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Modules built inside take `dtype` and `device` for what they create without a dtype, and
    keep what they create in float32 explicitly (rotary tables): how the loader builds a model,
    where casting a built module would round its tables too."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(prev)


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


class DecoderStack(nn.Module):
    """The trunk every decoder-only model shares: `embed` on the first pipeline stage, this stage's
    layers, `finish` (the final norm) on the last; a stage before the last hands its hidden states
    on. A model builds its modules under its checkpoint's names (its layers through `build_layers`)
    and names its embedding and final norm, or says what `embed` and `finish` do instead."""

    layers_take_positions = True  # False: learned position embeddings, which `embed` adds
    # Layers whose input (the residual stream) a forward keeps, side by side, in
    # `aux_hidden_states`: what an EAGLE-3 head reads. Set by its proposer.
    aux_hidden_layers: tuple[int, ...] = ()
    embed_name = "embed_tokens"
    norm_name = "norm"

    def build_layers(self, num_layers: int, build: Callable[[int], nn.Module]) -> nn.ModuleList:
        """This stage's layers (`make_layers`); the model keeps them under its checkpoint's name."""
        self.start_layer, self.end_layer, layers = make_layers(num_layers, build)
        # The same list, not registered again: its modules keep the one name the model gives them.
        self.__dict__["stage_layers"] = layers
        self.is_last_stage = get_pp_group().is_last_rank
        return layers

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.embed_name)(input_ids)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.norm_name)(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """Hidden states after `finish`; on a pipeline stage before the last, its layers' output.
        `inputs_embeds` (a multimodal prompt's: the tokens' embeddings with images merged in)
        replaces the embedding of `input_ids`."""
        if intermediate_tensors is not None:
            hidden = intermediate_tensors.hidden_states
        elif inputs_embeds is not None:
            hidden = inputs_embeds
        else:
            hidden = self.embed(input_ids, positions)
        layers, aux = self.stage_layers, self.aux_hidden_layers
        kept = []
        for i in range(self.start_layer, self.end_layer):
            if i in aux:
                kept.append(hidden)
            hidden = layers[i](positions, hidden) if self.layers_take_positions else layers[i](hidden)
        if aux:
            self.aux_hidden_states = torch.cat(kept, dim=-1)
        return self.finish(hidden) if self.is_last_stage else IntermediateTensors(hidden)


class DecoderForCausalLM(nn.Module):
    """A `DecoderStack` (under its checkpoint's name, `trunk_name`) and an LM head (`lm_head`)."""

    trunk_name = "model"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return getattr(self, self.trunk_name)(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, weights)


def lm_head_for(config: Any, embed: nn.Module, width: int | None = None) -> nn.Module:
    """The LM head, on the last stage only; it shares the embedding's weight where the config ties
    them and this stage holds the embedding (else it loads its own copy)."""
    tied = embed if config.tie_word_embeddings and not isinstance(embed, PPMissingLayer) else None
    return on_stage(False, lambda: ParallelLMHead(config.vocab_size, width or config.hidden_size, tied_to=tied))


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
