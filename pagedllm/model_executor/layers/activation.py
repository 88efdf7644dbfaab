"""Gated activations: act(gate) * up on a merged [gate | up] projection; on CPU one pass of
pagedllm's C kernel (torch: a chunk, the activation and a multiply, ~3x slower at batch 64).
`get_act_fn`: the plain activations of non-gated MLPs (StarCoder2's c_fc → act → c_proj)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.layers import cpu_kernels


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.usable(x):
            return cpu_kernels.act_and_mul(x, "silu")
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.usable(x):
            return cpu_kernels.act_and_mul(x, "gelu_tanh")
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


_ACTIVATIONS = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
}


def get_act_and_mul(name: str) -> nn.Module:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()


_PLAIN_ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": lambda: nn.SiLU(),
    "swish": lambda: nn.SiLU(),
    "relu": lambda: nn.ReLU(),
}


def get_act_fn(name: str) -> nn.Module:
    """An elementwise activation by its transformers name (`hidden_act`)."""
    if name not in _PLAIN_ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(_PLAIN_ACTIVATIONS)}")
    return _PLAIN_ACTIVATIONS[name]()
