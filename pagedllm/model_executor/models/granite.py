"""Granite: the Llama decoder with four multipliers: `embedding_multiplier` on the embeddings,
`residual_multiplier` on each attention and MLP output before its residual add,
`attention_multiplier` as the attention scale (in place of 1/sqrt(head_dim)), and logits divided
by `logits_scaling`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(
        self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__(config, layer_idx, rotary_emb, qkv_bias, qk_norm, mlp)
        self.self_attn.attn.scale = float(config.attention_multiplier)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden)) * self.residual_multiplier
        return hidden + self.mlp(self.post_attention_layernorm(hidden)) * self.residual_multiplier


class GraniteModel(LlamaModel):
    decoder_layer_cls = GraniteDecoderLayer

    def __init__(self, config: Any, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        super().__init__(config, max_model_len)
        self.logits_scaling = float(config.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling
