"""Gemma 3 (text): sliding-window and global layers with their own rope bases,
q/k RMSNorm, four norms per layer, embeddings scaled by sqrt(hidden_size). Split over the
tensor-parallel ranks like Llama (heads, MLP columns, vocabulary); the logit softcap applies to
each rank's slice of the logits."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm
from pagedllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq
from pagedllm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.model_executor.models.blocks import GatedMLP
from pagedllm.model_executor.models.utils import PACKED_MODULES, DecoderForCausalLM, DecoderStack, lm_head_for, on_stage

logger = logging.getLogger(__name__)


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        total_heads = config.num_attention_heads
        bias = bool(config.attention_bias)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, config.num_key_value_heads, bias=bias
        )
        # This rank's heads (all of them at one rank): the attention and its KV cache hold only these.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            config.query_pre_attn_scalar**-0.5,
            config.sliding_window if is_sliding else None,
            getattr(config, "attn_logit_softcapping", None),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.rotary_emb.forward_qkv(
            positions, self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim,
            self.q_norm, self.k_norm,
        )
        o = self.attn(q, k, v)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_idx, rotary_emb)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = self.post_attention_layernorm(attn, residual=hidden)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return self.post_feedforward_layernorm(mlp, residual=hidden)


class Gemma3Model(DecoderStack):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = on_stage(True, lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size))
        self.embed_scale = config.hidden_size**0.5
        ropes = {}
        for layer_type in sorted(set(config.layer_types)):
            inv_freq, scaling = compute_inv_freq(config, config.head_dim, layer_type)
            ropes[layer_type] = RotaryEmbedding(inv_freq, config.max_position_embeddings, scaling)
        self.layers = self.build_layers(
            config.num_hidden_layers, lambda i: Gemma3DecoderLayer(config, i, ropes[config.layer_types[i]]))
        self.norm = on_stage(False, lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # The scale is rounded to the activation dtype first, as the reference does.
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)


class Gemma3ForCausalLM(DecoderForCausalLM):
    packed_modules_mapping = PACKED_MODULES

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = lm_head_for(config, self.model.embed_tokens)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden, softcap=self.final_logit_softcapping)
