"""RMSNorm in the two flavours the supported models use, and LayerNorm with a bias (StarCoder2).

On CPU both run pagedllm's C kernel (one pass per row, float32 inside); F.rms_norm is ~7 aten
ops there, and a decode step makes 6 norm calls per layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.custom_op import CustomOp
from pagedllm.model_executor.layers import cpu_kernels


class _CachedScale:
    """A float32 function of a norm's weight, recomputed only when the weight changes."""

    __slots__ = ("key", "value")

    def __init__(self) -> None:
        self.key: tuple = ()
        self.value: torch.Tensor | None = None

    def get(self, weight: torch.Tensor, offset: float) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, weight.device)
        if self.key != key:
            self.value, self.key = offset + weight.detach().float(), key
        return self.value


class RMSNorm(CustomOp):
    """Llama style: normalise in float32, cast back, then scale by `weight`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self._scale = _CachedScale()

    gemma_style = False

    def kernel_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The float32 weight the C kernels take for input x, or None if they cannot."""
        return self._scale.get(self.weight, 0.0) if self.weight.dtype == x.dtype else None

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is one fused op, bit-identical to x * rsqrt(mean(x^2) + eps) here.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != x.dtype:
            return self.forward_native(x)
        return cpu_kernels.rms_norm(x, self.kernel_weight(x), self.eps, gemma=False)


class GemmaRMSNorm(CustomOp):
    """Gemma style: the weight is stored as an offset from one and applied in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self._scale = _CachedScale()

    gemma_style = True

    def kernel_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The float32 weight (1 + w) the C kernels take."""
        return self._scale.get(self.weight, 1.0)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of `x`, plus `residual` when given (Gemma's post-norms feed a residual add)."""
        out = F.rms_norm(x.float(), self.weight.shape, self._scale.get(self.weight, 1.0), self.eps).to(x.dtype)
        return out if residual is None else residual + out

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None and residual.dtype != x.dtype:
            return self.forward_native(x, residual)
        return cpu_kernels.rms_norm(x, self._scale.get(self.weight, 1.0), self.eps, gemma=True, residual=residual)


class LayerNorm(nn.Module):
    """Mean-centred norm with weight and bias (nn.LayerNorm's checkpoint names), in the input dtype as
    transformers' nn.LayerNorm runs it."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
