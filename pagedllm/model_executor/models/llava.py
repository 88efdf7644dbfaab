"""LLaVA-1.5: a CLIP vision tower, a two-layer projector and a Llama-family decoder.

The vision tower is transformers' own module (`AutoModel.from_config(vision_config)`), replicated
on every tensor-parallel rank: it is a small share of the work, and it computes exactly what the
reference computes. The decoder is pagedllm's (paged attention, tensor parallel, quantized
linears); images reach it as embeddings merged at their placeholder tokens (the model runner's
`inputs_embeds`)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.linear import default_weight_loader
from pagedllm.model_executor.models.registry import resolve_model_cls
from pagedllm.model_executor.models.utils import IntermediateTensors

# The decoder class for a text config's model_type, when the config does not name it.
_TEXT_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "gemma3_text": "Gemma3ForCausalLM", "qwen2_vl_text": "Qwen2ForCausalLM",
               "qwen2_5_vl_text": "Qwen2ForCausalLM"}


def text_model_for(text_config: Any, max_model_len: int | None) -> nn.Module:
    arch = _TEXT_ARCHS.get(text_config.model_type) or (getattr(text_config, "architectures", None) or [""])[0]
    cls = resolve_model_cls(arch)
    takes_len = "max_model_len" in inspect.signature(cls).parameters
    return cls(text_config, max_model_len=max_model_len) if takes_len else cls(text_config)


def vision_tower_for(vision_config: Any) -> nn.Module:
    """transformers' vision model for the config (CLIP, SigLIP), in the default dtype set by the loader."""
    from transformers import AutoModel

    return AutoModel.from_config(vision_config, dtype=torch.get_default_dtype())


class ModuleLoader:
    """Whole checkpoint tensors into a plain module's parameters, as they stream by (a lazy
    checkpoint tensor must be read while its file is open); `check()` after the stream."""

    def __init__(self, module: nn.Module, what: str) -> None:
        self.params = dict(module.named_parameters())
        self.what = what
        self.loaded: set[str] = set()

    def load(self, name: str, tensor: Any) -> None:
        param = self.params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {self.what}.{name} has no matching parameter")
        default_weight_loader(param, tensor)
        self.loaded.add(name)

    def check(self) -> None:
        missing = set(self.params) - self.loaded
        if missing:
            raise ValueError(f"checkpoint is missing {self.what} weights: {sorted(missing)[:8]}")


class LlavaProjector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        layers = config.vision_feature_layer
        width = config.vision_config.hidden_size * (1 if isinstance(layers, int) else len(layers))
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(width, config.text_config.hidden_size, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(config.text_config.hidden_size, config.text_config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    supports_multimodal = True  # built from the whole config; `embed_multimodal` makes image embeddings

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = vision_tower_for(config.vision_config)
        self.multi_modal_projector = LlavaProjector(config)
        self.language_model = text_model_for(config.text_config, max_model_len)

    # ---- images -------------------------------------------------------------
    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One [placeholder tokens, hidden] tensor per image, all images in one tower pass (every
        LLaVA-1.5 image is resized to the tower's size)."""
        pixels = torch.cat([item["pixel_values"] for item in items]).to(self.multi_modal_projector.linear_1.weight)
        out = self.vision_tower(pixels, output_hidden_states=True, return_dict=True)
        layers = self.config.vision_feature_layer
        selected = [out.hidden_states[i] for i in ([layers] if isinstance(layers, int) else layers)]
        if self.config.vision_feature_select_strategy == "default":  # drop the CLS position
            selected = [h[:, 1:] for h in selected]
        return list(self.multi_modal_projector(torch.cat(selected, dim=-1)))

    def embed_input_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        trunk = self.language_model.model
        return trunk.embed(input_ids, positions)

    # ---- the decoder --------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.language_model.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Both layouts of the checkpoint names: transformers 4's (`language_model.model.*`,
        `language_model.lm_head.*`, `vision_tower.vision_model.*`) and the newer
        `model.language_model.*` / `model.vision_tower.*` / `lm_head.*`."""
        tower = ModuleLoader(self.vision_tower, "vision_tower")
        projector = ModuleLoader(self.multi_modal_projector, "multi_modal_projector")

        def text_weights():
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith("vision_tower."):
                    tower.load(name.removeprefix("vision_tower.").removeprefix("vision_model."), tensor)
                elif name.startswith("multi_modal_projector."):
                    projector.load(name.removeprefix("multi_modal_projector."), tensor)
                elif name.startswith("language_model.model."):
                    yield "model." + name.removeprefix("language_model.model."), tensor
                elif name.startswith("language_model."):  # language_model.lm_head.*, or (newer) .layers.* etc.
                    rest = name.removeprefix("language_model.")
                    yield (rest if rest.startswith("lm_head.") else "model." + rest), tensor
                elif name.startswith("lm_head."):
                    yield name, tensor
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")

        loaded = self.language_model.load_weights(text_weights())
        tower.check()
        projector.check()
        return loaded
