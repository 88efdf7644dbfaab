"""StarCoder2: a pre-norm decoder like Llama's but with LayerNorm (weight and bias, `norm_epsilon`),
biases on every projection (`use_bias`), a plain (not gated) MLP c_fc → GELU(tanh) → c_proj, a
sliding window on every layer when configured, and embeddings tied to the LM head. Split over the
tensor-parallel ranks like Llama: heads, the MLP's columns (c_fc) and rows (c_proj), the vocabulary."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.model_executor.layers.activation import get_act_fn
from pagedllm.model_executor.layers.layernorm import LayerNorm
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model_executor.models.blocks import UngatedMLP
from pagedllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its attention's biases come from `use_bias`) with LayerNorms and the MLP
    `Starcoder2ForCausalLM.make_mlp` gives it; the trunk's final norm follows `make_norm` too."""

    @staticmethod
    def make_norm(config: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.norm_epsilon)


class Starcoder2Model(LlamaModel):
    decoder_layer_cls = Starcoder2DecoderLayer


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_cls = Starcoder2Model

    def make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        return UngatedMLP(ColumnParallelLinear(c.hidden_size, c.intermediate_size, bias=bool(c.use_bias)),
                          RowParallelLinear(c.intermediate_size, c.hidden_size, bias=bool(c.use_bias)),
                          get_act_fn(c.hidden_act), ("c_fc", "c_proj"))
