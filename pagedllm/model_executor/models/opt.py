"""OPT (facebook/opt-*): learned absolute positions (the table offset by 2), pre- or post-LayerNorm
layers (`do_layer_norm_before`; opt-350m is post-norm and has no final norm), a ReLU MLP, biases
throughout, and, where `word_embed_proj_dim != hidden_size`, the embeddings projected in and the
last hidden state projected out. Heads, MLP columns and the vocabulary are split over the
tensor-parallel ranks; the position table and the two projections are whole on every rank."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.activation import get_act_fn
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, Linear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.vocab_embedding import (
    LearnedPositionEmbedding,
    VocabParallelEmbedding,
)
from pagedllm.model_executor.models.blocks import attend_packed_qkv
from pagedllm.model_executor.models.utils import (
    PACKED_MODULES,
    DecoderForCausalLM,
    DecoderStack,
    IntermediateTensors,
    lm_head_for,
    load_weights,
    on_stage,
)

POSITION_OFFSET = 2  # OPT's table keeps two rows before position 0


def _layer_norm(config: Any) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, elementwise_affine=config.layer_norm_elementwise_affine)


class OPTAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        heads, bias = config.num_attention_heads, config.enable_bias
        self.head_dim = config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, heads, bias=bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=bias)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads, self.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(attend_packed_qkv(self.attn, self.qkv_proj(hidden), self.num_heads, self.head_dim))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = _layer_norm(config)
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, config.hidden_size, bias=config.enable_bias)
        self.act = get_act_fn(config.activation_function)
        self.final_layer_norm = _layer_norm(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            hidden = hidden + self.self_attn(self.self_attn_layer_norm(hidden))
            return hidden + self.fc2(self.act(self.fc1(self.final_layer_norm(hidden))))
        hidden = self.self_attn_layer_norm(hidden + self.self_attn(hidden))
        return self.final_layer_norm(hidden + self.fc2(self.act(self.fc1(hidden))))


class OPTDecoder(DecoderStack):
    layers_take_positions = False  # learned positions, added to the embeddings

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = on_stage(True, lambda: VocabParallelEmbedding(config.vocab_size, proj))
        self.embed_positions = on_stage(True, lambda: LearnedPositionEmbedding(
            config.max_position_embeddings, hidden, POSITION_OFFSET))
        if proj != hidden:
            self.project_in = on_stage(True, lambda: Linear(proj, hidden))
            self.project_out = on_stage(False, lambda: Linear(hidden, proj))
        else:
            self.project_in = self.project_out = None
        if config.do_layer_norm_before and not config._remove_final_layer_norm:
            self.final_layer_norm = on_stage(False, lambda: _layer_norm(config))
        else:
            self.final_layer_norm = None
        self.layers = self.build_layers(config.num_hidden_layers, lambda i: OPTDecoderLayer(config))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        return hidden + self.embed_positions(positions)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        return hidden if self.project_out is None else self.project_out(hidden)


class OPTModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(DecoderForCausalLM):
    # q/k/v are separate in the checkpoint, stacked into one GEMM here.
    packed_modules_mapping = {k: v for k, v in PACKED_MODULES.items() if v[0] == "qkv_proj"}
    tied_weight_names = ("model.decoder.embed_tokens.weight", "lm_head.weight")

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        self.lm_head = lm_head_for(config, self.model.decoder.embed_tokens, config.word_embed_proj_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model.decoder(input_ids, positions, intermediate_tensors)

    def load_weights(self, weights) -> set[str]:
        # Metaseq-converted checkpoints (facebook/opt-125m's) name the decoder without "model.".
        return load_weights(self, ((f"model.{n}" if n.startswith("decoder.") else n, t) for n, t in weights))
