"""The EAGLE head (method "eagle") in the Hub's layout (`yuhuili/EAGLE-LLaMA3-Instruct-8B`):
`config.json` a Llama config (usually one layer), and `pytorch_model.bin` or `model.safetensors`
with `fc.weight` [H, 2H] (and `fc.bias` where trained with one), `layers.{i}.*` (layer 0 without
`input_layernorm`), no final norm, and `embed_tokens.weight` only where the head has its own
(else it uses the target's). Also the config check of EAGLE and EAGLE-3 heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.config import ModelConfig, SpeculativeConfig
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq
from pagedllm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.model_executor.models.llama import LlamaDecoderLayer, head_dim_of
from pagedllm.model_executor.models.utils import PACKED_MODULES, building_in, load_weights
from pagedllm.spec_decode.eagle3 import aux_layer_ids, check_eagle3_config
from pagedllm.spec_decode.head_files import load_head_tensors

EAGLE_FILES = ("model.safetensors", "pytorch_model.bin")


def eagle_config(spec: SpeculativeConfig, path: str, target: ModelConfig) -> Any:
    """The head's transformers config, checked against the target (EAGLE-3: also the target
    layers it reads)."""
    from transformers import AutoConfig

    what = "EAGLE-3 head" if spec.method == "eagle3" else "EAGLE head"
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what} at {path!r}: no readable config.json ({e})") from None
    if config.model_type != "llama":
        raise ValueError(f"{what} at {path!r}: model_type {config.model_type!r}; the {what.removesuffix(' head')} "
                         "layout loaded here is Llama decoder layers (model_type 'llama')")
    text = target.text_config
    if (config.hidden_size, config.vocab_size) != (text.hidden_size, text.vocab_size):
        raise ValueError(f"{what} at {path!r} takes hidden size {config.hidden_size} and vocabulary "
                         f"{config.vocab_size}; the target has {text.hidden_size} and {text.vocab_size}")
    if spec.method == "eagle3":
        check_eagle3_config(path, config)
        aux_layer_ids(config, text.num_hidden_layers)
    return config


class EagleHead(nn.Module):
    """fc over [embedding; hidden], then the decoder layers; returns the predicted hidden state."""

    packed_modules_mapping = PACKED_MODULES
    tied_weight_names = ("embed_tokens.weight", "lm_head.weight")  # an LM head in the file is the target's: skipped

    def __init__(self, config: Any, own_embedding: bool, fc_bias: bool, max_model_len: int) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h) if own_embedding else None
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        inv_freq, scaling = compute_inv_freq(config, head_dim_of(config), max_model_len=max_model_len)
        rotary = RotaryEmbedding(inv_freq, config.max_position_embeddings, scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, rotary, False, False)
                                    for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()  # fc's output goes straight into attention

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat((embeds, hidden.to(embeds.dtype)), dim=-1))
        for layer in self.layers:
            x = layer(positions, x)
        return x


def _expected_tensors(config: Any) -> list[str]:
    names = ["fc.weight"]
    for i in range(config.num_hidden_layers):
        parts = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
        parts += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        parts += ["post_attention_layernorm.weight"] + (["input_layernorm.weight"] if i else [])
        names += [f"layers.{i}.{part}" for part in parts]
    return names


def load_eagle_head(path: str, config: Any, dtype: torch.dtype, device: torch.device,
                    max_model_len: int) -> EagleHead:
    tensors = load_head_tensors(path, EAGLE_FILES, "EAGLE head")
    missing = sorted(set(_expected_tensors(config)) - set(tensors))
    if missing:  # a packed parameter (q/k/v, gate/up) with one part absent would otherwise pass
        raise ValueError(f"EAGLE head at {path!r}: missing tensors {missing[:4]}")
    with building_in(dtype, device):
        head = EagleHead(config, "embed_tokens.weight" in tensors, "fc.bias" in tensors, max_model_len)
    try:
        load_weights(head, tensors.items())
    except ValueError as e:
        raise ValueError(f"EAGLE head at {path!r}: {e}") from None
    return head.eval()
