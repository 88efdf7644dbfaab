"""vLLM's `CustomOp` pattern: an op written once in plain torch (`forward_native`, any device)
and again where pagedllm has a kernel of its own for a platform (`forward_cpu`: the C kernels of
`layers/cpu_kernels.py`; `forward_cuda`). `forward` picks per call, by the input tensor: the CPU
kernels only once they are built and for float32 / bfloat16 on CPU (`cpu_kernels.usable`), so a
layer states its paths side by side instead of branching inside one forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers import cpu_kernels


class CustomOp(nn.Module):
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if x.is_cuda:
            return self.forward_cuda(x, *args, **kwargs)
        if cpu_kernels.usable(x):
            return self.forward_cpu(x, *args, **kwargs)
        return self.forward_native(x, *args, **kwargs)

    def forward_native(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """With the C kernels available for `x`; an op may still fall back for other operands."""
        return self.forward_native(x, *args, **kwargs)

    def forward_cuda(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(x, *args, **kwargs)
