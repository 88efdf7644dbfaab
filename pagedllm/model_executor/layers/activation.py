"""Gated activations: act(gate) * up on a merged [gate | up] projection; on CPU one pass of
pagedllm's C kernel (torch: a chunk, the activation and a multiply, ~3x slower at batch 64)."""

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
