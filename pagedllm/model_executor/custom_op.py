"""vLLM's `CustomOp` pattern: an op written once in plain torch (`forward_native`, any device)
and again where pagedllm has a kernel of its own for a platform (`forward_cpu`: the C kernels of
`layers/cpu_kernels.py`; `forward_cuda`). `forward` picks per call, by the input tensor, so a
layer states its paths side by side instead of branching inside one forward.

`platform_of` is the one place that choice is made: the CPU kernels only once they are built and
for float32 / bfloat16 CPU tensors. `CustomFn` applies it to plain functions (the sampler's argmax,
the head's top-k), and a layer whose kernel also has shape limits asks it before taking its
kernel path (`Attention`, `RotaryEmbedding.forward_qkv`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from pagedllm.model_executor.layers import cpu_kernels

Platform = Literal["cuda", "cpu", "native"]


def platform_of(x: torch.Tensor, *operands: torch.Tensor) -> Platform:
    """Which implementation serves `x` (and `operands`, all of which a CPU kernel must take)."""
    if x.is_cuda:
        return "cuda"
    if cpu_kernels.usable(x, *operands):
        return "cpu"
    return "native"


class CustomOp(nn.Module):
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        platform = platform_of(x)
        if platform == "cuda":
            return self.forward_cuda(x, *args, **kwargs)
        if platform == "cpu":
            return self.forward_cpu(x, *args, **kwargs)
        return self.forward_native(x, *args, **kwargs)

    def forward_native(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """With the C kernels available for `x`; an op may still fall back for other operands."""
        return self.forward_native(x, *args, **kwargs)

    def forward_cuda(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(x, *args, **kwargs)


class CustomFn:
    """A function with a plain-torch body and optional platform kernels, picked per call by
    `platform_of` of its first argument, as `CustomOp.forward` picks."""

    def __init__(self, native: Callable[..., Any], cpu: Callable[..., Any] | None = None,
                 cuda: Callable[..., Any] | None = None) -> None:
        self.native = native
        self.cpu = cpu or native
        self.cuda = cuda or native
        self.__doc__ = native.__doc__

    def __call__(self, x: torch.Tensor, *args: Any) -> Any:
        platform = platform_of(x)
        if platform == "cuda":
            return self.cuda(x, *args)
        if platform == "cpu":
            return self.cpu(x, *args)
        return self.native(x, *args)
