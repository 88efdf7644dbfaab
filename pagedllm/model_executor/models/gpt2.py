"""GPT-2: learned absolute positions (wpe), pre-LayerNorm layers, fused qkv (c_attn), a gelu_new
MLP, biases throughout, the LM head tied to wte.

The checkpoint keeps its projections as Conv1D, [in, out]: their loaders transpose the tensor
and then slice it like any nn.Linear one, so heads, MLP columns and the vocabulary split over the
tensor-parallel ranks as in Llama; the position table is whole on every rank."""

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
    transposed_loader,
)
from pagedllm.model_executor.layers.vocab_embedding import (
    LearnedPositionEmbedding,
    VocabParallelEmbedding,
)
from pagedllm.model_executor.models.blocks import UngatedMLP, attend_packed_qkv
from pagedllm.model_executor.models.utils import (
    DecoderForCausalLM,
    DecoderStack,
    lm_head_for,
    load_weights,
    on_stage,
)


def _conv1d(layer: nn.Module) -> nn.Module:
    """The layer, its weight read from a Conv1D checkpoint tensor ([in, out])."""
    layer.weight.weight_loader = transposed_loader(layer.weight.weight_loader)
    return layer


def check_gpt2_config(config: Any) -> None:
    """Refuse what this implementation does not compute as transformers does."""
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with add_cross_attention=True (an encoder-decoder's decoder) is not supported")
    if getattr(config, "reorder_and_upcast_attn", False) and torch.get_default_dtype() != torch.float32:
        raise ValueError("GPT-2 with reorder_and_upcast_attn=True computes its attention scores in float32: "
                         "run it with dtype='float32'")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        self.c_attn = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True)
        self.c_attn.weight.weight_loader = transposed_loader(fused_qkv_loader(self.c_attn))
        self.c_attn.bias.weight_loader = fused_qkv_loader(self.c_attn)
        self.num_heads = self.c_attn.num_heads  # this rank's
        self.c_proj = _conv1d(RowParallelLinear(hidden, hidden, bias=True))
        scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads, scale)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.c_proj(attend_packed_qkv(self.attn, self.c_attn(hidden), self.num_heads, self.head_dim))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        inner = config.n_inner or 4 * config.hidden_size
        self.mlp = UngatedMLP(_conv1d(ColumnParallelLinear(config.hidden_size, inner, bias=True)),
                              _conv1d(RowParallelLinear(inner, config.hidden_size, bias=True)),
                              get_act_fn(config.activation_function), ("c_fc", "c_proj"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden))
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(DecoderStack):
    layers_take_positions = False  # learned positions, added to the embeddings
    norm_name = "ln_f"

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.wte = on_stage(True, lambda: VocabParallelEmbedding(config.vocab_size, hidden))
        self.wpe = on_stage(True, lambda: LearnedPositionEmbedding(config.max_position_embeddings, hidden))
        self.h = self.build_layers(config.num_hidden_layers, lambda i: GPT2Block(config, i))
        self.ln_f = on_stage(False, lambda: nn.LayerNorm(hidden, eps=config.layer_norm_epsilon))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids) + self.wpe(positions)



class GPT2LMHeadModel(DecoderForCausalLM):
    tied_weight_names = ("transformer.wte.weight", "lm_head.weight")
    trunk_name = "transformer"

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_gpt2_config(config)
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = lm_head_for(config, self.transformer.wte)

    def load_weights(self, weights) -> set[str]:
        def renamed():
            for name, tensor in weights:
                # Old checkpoints (openai-community/gpt2) keep the causal-mask buffers and no prefix.
                if name.endswith((".attn.bias", ".attn.masked_bias")):
                    continue
                if not name.startswith(("transformer.", "lm_head.")):
                    name = f"transformer.{name}"
                yield name, tensor

        return load_weights(self, renamed())
