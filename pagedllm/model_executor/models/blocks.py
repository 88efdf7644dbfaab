"""Blocks several models are built from (mini-sglang's shared blocks are the pattern): a model
file says what differs, not the block again."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model_executor.layers.activation import get_act_and_mul
from pagedllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """down_proj(act(gate) * up), gate and up in one GEMM (`gate_up_proj`, split over the
    tensor-parallel ranks by columns, down_proj by rows): Llama's, Gemma's, Qwen's MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = get_act_and_mul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class UngatedMLP(nn.Module):
    """down(act(up(x))): GPT-2's, GPT-NeoX's and StarCoder2's MLP. The two linears keep the names
    the checkpoint gives them (`names`: up's, down's), so their weights load as they are."""

    def __init__(self, up: nn.Module, down: nn.Module, act: nn.Module, names: tuple[str, str]) -> None:
        super().__init__()
        self.up_name, self.down_name = names
        self.add_module(self.up_name, up)
        self.add_module(self.down_name, down)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.down_name)(self.act(getattr(self, self.up_name)(x)))


def attend_packed_qkv(attn: nn.Module, qkv: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Attention over q | k | v side by side in one row ([tokens, 3 * heads * head_dim]), with no
    rotary (GPT-2's c_attn, OPT's stacked q/k/v): [tokens, heads * head_dim], for the output
    projection."""
    q, k, v = qkv.view(-1, 3, num_heads, head_dim).unbind(1)
    return attn(q.contiguous(), k, v).reshape(-1, num_heads * head_dim)
