"""StarCoder2: a pre-norm decoder like Llama's but with LayerNorm (weight and bias, `norm_epsilon`),
biases on every projection (`use_bias`), a plain (not gated) MLP c_fc → GELU(tanh) → c_proj, a
sliding window on every layer when configured, and embeddings tied to the LM head. Split over the
tensor-parallel ranks like Llama: heads, the MLP's columns (c_fc) and rows (c_proj), the vocabulary."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.activation import get_act_fn
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.layernorm import LayerNorm
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq
from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_executor.models.llama import head_dim_of
from pagedllm.model_executor.models.utils import (
    PACKED_MODULES,
    IntermediateTensors,
    PPMissingLayer,
    load_weights,
    make_layers,
    on_stage,
)


class Starcoder2Attention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        total_heads = config.num_attention_heads
        bias = bool(config.use_bias)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, config.num_key_value_heads, bias=bias
        )
        # This rank's heads (all of them at one rank): the attention and its KV cache hold only these.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, config.sliding_window
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.rotary_emb.forward_qkv(
            positions, self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim
        )
        o = self.attn(q, k, v)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class Starcoder2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(config.use_bias)
        self.c_fc = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=bias)
        self.act = get_act_fn(config.hidden_act)
        self.c_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Starcoder2Attention(config, rotary_emb)
        self.mlp = Starcoder2MLP(config)
        self.input_layernorm = LayerNorm(config.hidden_size, config.norm_epsilon)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.norm_epsilon)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Starcoder2Model(nn.Module):
    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        super().__init__()
        self.embed_tokens = on_stage(True, lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size))
        inv_freq, scaling = compute_inv_freq(config, head_dim_of(config), max_model_len=max_model_len)
        rotary_emb = RotaryEmbedding(inv_freq, config.max_position_embeddings, scaling)  # shared by every layer
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: Starcoder2DecoderLayer(config, rotary_emb))
        self.norm = on_stage(False, lambda: LayerNorm(config.hidden_size, config.norm_epsilon))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        hidden = self.embed_tokens(input_ids) if intermediate_tensors is None else intermediate_tensors.hidden_states
        for i in range(self.start_layer, self.end_layer):
            hidden = self.layers[i](positions, hidden)
        if isinstance(self.norm, PPMissingLayer):
            return IntermediateTensors(hidden)
        return self.norm(hidden)


class Starcoder2ForCausalLM(nn.Module):
    packed_modules_mapping = PACKED_MODULES

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = Starcoder2Model(config, max_model_len)
        embed = self.model.embed_tokens
        tied = embed if config.tie_word_embeddings and not isinstance(embed, PPMissingLayer) else None
        self.lm_head = on_stage(False, lambda: ParallelLMHead(config.vocab_size, config.hidden_size, tied_to=tied))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, weights)
