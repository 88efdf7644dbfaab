"""GPT-NeoX (EleutherAI Pythia, gpt-neox-20b): fused query_key_value interleaved per head
([heads, 3, head_dim] along the outputs), rotary on the first `partial_rotary_factor` (rotary_pct)
of each head, attention and MLP added to the residual in parallel (`use_parallel_residual`) or
one after the other, LayerNorm with bias, a gelu MLP, a separate `embed_out` head.

The qkv loader de-interleaves the checkpoint tensor into the q | k | v layout QKVParallelLinear
keeps, so heads, MLP columns and the vocabulary split over the tensor-parallel ranks as in Llama."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.activation import get_act_fn
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    fused_qkv_loader,
)
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq
from pagedllm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.model_executor.models.blocks import UngatedMLP
from pagedllm.model_executor.models.utils import (
    DecoderForCausalLM,
    DecoderStack,
    lm_head_for,
    load_weights,
    on_stage,
)


class GPTNeoXAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        bias = getattr(config, "attention_bias", True)
        self.head_dim = hidden // heads
        self.query_key_value = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=bias)
        self.query_key_value.weight.weight_loader = fused_qkv_loader(self.query_key_value, interleaved=True)
        if bias:
            self.query_key_value.bias.weight_loader = fused_qkv_loader(self.query_key_value, interleaved=True)
        self.num_heads = self.query_key_value.num_heads  # this rank's
        self.dense = RowParallelLinear(hidden, hidden, bias=bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.rotary_emb.forward_qkv(
            positions, self.query_key_value(hidden), self.num_heads, self.num_heads, self.head_dim
        )
        o = self.attn(q, k, v)
        return self.dense(o.reshape(-1, self.num_heads * self.head_dim))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = GPTNeoXAttention(config, rotary_emb)
        self.mlp = UngatedMLP(ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True),
                              RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True),
                              get_act_fn(config.hidden_act), ("dense_h_to_4h", "dense_4h_to_h"))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attn = self.attention(positions, self.input_layernorm(hidden))
        if self.parallel_residual:
            # In transformers' order of addition: mlp + attn + x.
            return self.mlp(self.post_attention_layernorm(hidden)) + attn + hidden
        hidden = attn + hidden
        return self.mlp(self.post_attention_layernorm(hidden)) + hidden


class GPTNeoXModel(DecoderStack):
    embed_name, norm_name = "embed_in", "final_layer_norm"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_in = on_stage(True, lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size))
        inv_freq, scaling = compute_inv_freq(config, config.hidden_size // config.num_attention_heads)
        # One cos/sin table (over the rotary part of a head) shared by every layer.
        rotary_emb = RotaryEmbedding(inv_freq, config.max_position_embeddings, scaling)
        self.layers = self.build_layers(config.num_hidden_layers, lambda i: GPTNeoXLayer(config, rotary_emb))
        self.final_layer_norm = on_stage(False, lambda: nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps))



class GPTNeoXForCausalLM(DecoderForCausalLM):
    tied_weight_names = ("gpt_neox.embed_in.weight", "embed_out.weight")
    trunk_name = "gpt_neox"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.gpt_neox = GPTNeoXModel(config)
        self.embed_out = lm_head_for(config, self.gpt_neox.embed_in)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.embed_out(hidden)

    def load_weights(self, weights) -> set[str]:
        # Older checkpoints (Pythia's) also carry each layer's causal-mask buffers.
        return load_weights(self, ((n, t) for n, t in weights
                                   if not n.endswith((".attention.bias", ".attention.masked_bias"))))
