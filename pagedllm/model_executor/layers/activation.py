"""Gated activations: act(gate) * up on a merged [gate | up] projection; on CPU one pass of
pagedllm's C kernel (torch: a chunk, the activation and a multiply, ~3x slower at batch 64); and the
plain ones of ungated MLPs (OPT, GPT-2, GPT-NeoX, StarCoder2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.custom_op import CustomOp
from pagedllm.model_executor.layers import cpu_kernels


class SiluAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.act_and_mul(x, "silu")


class GeluTanhAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.act_and_mul(x, "gelu_tanh")


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


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


# Ungated activations by their HF config names (`hidden_act`, `activation_function`). gelu_new and
# gelu_fast are the tanh approximation written out; F.gelu(approximate="tanh") computes the same.
_PLAIN_ACTIVATIONS = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_fast": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "quick_gelu": QuickGELU,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
}


def get_act_fn(name: str) -> nn.Module:
    """An ungated activation (MLPs of the form fc2(act(fc1(x)))), by its HF config name."""
    if name not in _PLAIN_ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(_PLAIN_ACTIVATIONS)}")
    return _PLAIN_ACTIVATIONS[name]()
