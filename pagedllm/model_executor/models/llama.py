"""Llama decoder (also Mistral); Qwen2 and Qwen3 reuse it with bias / q-k norm switched on.

Attention heads, MLP columns and the vocabulary are split over the tensor-parallel ranks by the
parallel layers (layers/linear.py, layers/vocab_embedding.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import (
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.model_executor.layers.rotary_embedding import MRotaryEmbedding, RotaryEmbedding, compute_inv_freq
from pagedllm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.model_executor.models.blocks import GatedMLP
from pagedllm.model_executor.models.utils import (
    PACKED_MODULES,
    DecoderForCausalLM,
    DecoderStack,
    lm_head_for,
    on_stage,
)


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, qkv_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        # StarCoder2 names it use_bias (and biases the MLP too)
        attention_bias = bool(getattr(config, "attention_bias", getattr(config, "use_bias", False)))
        self.head_dim = head_dim_of(config)
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            total_heads,
            total_kv_heads,
            bias=qkv_bias or attention_bias,
        )
        # This rank's heads (all of them at one rank): the attention and its KV cache hold only these.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=attention_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        layer_types = getattr(config, "layer_types", None)
        sliding = getattr(config, "sliding_window", None)
        if layer_types is not None:
            sliding = sliding if layer_types[layer_idx] == "sliding_attention" else None
        elif not getattr(config, "use_sliding_window", True):
            sliding = None
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, sliding
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        q, k, v = self.rotary_emb.forward_qkv(
            positions, self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim, q_norm, k_norm
        )
        o = self.attn(q, k, v)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


def llama_mlp(config: Any) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, getattr(config, "mlp_bias", False))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb, qkv_bias, qk_norm)
        self.mlp = mlp if mlp is not None else llama_mlp(config)
        self.input_layernorm = self.make_norm(config)
        self.post_attention_layernorm = self.make_norm(config)

    @staticmethod
    def make_norm(config: Any) -> nn.Module:
        """The layer's and the trunk's norms (StarCoder2 swaps in LayerNorm)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(DecoderStack):
    """`make_mlp(layer_idx)`, when given, builds each layer's feed-forward block (the MoE models')."""

    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer  # variants (Granite) swap in their own

    def __init__(
        self, config: Any, qkv_bias: bool = False, qk_norm: bool = False, max_model_len: int | None = None,
        make_mlp: Callable[[int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = on_stage(True, lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size))
        inv_freq, scaling = compute_inv_freq(config, head_dim_of(config), max_model_len=max_model_len)
        # One cos/sin table shared by every layer; Qwen2-VL's decoder rotates by three position streams.
        mrope_section = (getattr(config, "rope_parameters", None) or {}).get("mrope_section")
        rotary_emb = (MRotaryEmbedding(inv_freq, config.max_position_embeddings, scaling, mrope_section)
                      if mrope_section else RotaryEmbedding(inv_freq, config.max_position_embeddings, scaling))
        layer_cls = self.decoder_layer_cls
        self.layers = self.build_layers(
            config.num_hidden_layers,
            lambda i: layer_cls(config, i, rotary_emb, qkv_bias, qk_norm, make_mlp(i) if make_mlp else None))
        self.norm = on_stage(False, lambda: layer_cls.make_norm(config))



class _LlamaHost(DecoderForCausalLM):
    """A Llama decoder under a task head: the weights, forward pass and loading they share."""

    packed_modules_mapping = PACKED_MODULES
    model_cls: type[LlamaModel] = LlamaModel
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, self.qkv_bias, self.qk_norm, max_model_len, self.make_mlp)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s feed-forward block: the dense MLP here; experts in the MoE models."""
        return llama_mlp(self.config)


class LlamaForCausalLM(_LlamaHost):
    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        super().__init__(config, max_model_len)
        self.lm_head = lm_head_for(config, self.model.embed_tokens)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class LlamaForSequenceClassification(_LlamaHost):
    """The decoder with a linear `score` head instead of the LM head: the runner's LAST pooling
    (the prompt's last token) feeds `classify`, which returns the logits."""

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        super().__init__(config, max_model_len)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled.to(self.score.weight.dtype)).float()
