"""RMSNorm in the two flavours the supported models use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama style: normalise in float32, cast back, then scale by `weight`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is one fused op, bit-identical to x * rsqrt(mean(x^2) + eps) here.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma style: the weight is stored as an offset from one and applied in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        # 1 + weight in float32, kept until the weight changes: two fewer ops per call, and a
        # decode step makes 6 such calls per layer.
        self._scale: torch.Tensor | None = None
        self._scale_key: tuple = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, w.device)
        if self._scale_key != key:
            self._scale, self._scale_key = 1.0 + w.detach().float(), key
        return F.rms_norm(x.float(), self.weight.shape, self._scale, self.eps).to(x.dtype)
