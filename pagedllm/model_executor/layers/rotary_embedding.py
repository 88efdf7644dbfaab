"""Rotary position embedding with a precomputed cos/sin table (neox / rotate-half style)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def compute_inv_freq(config: Any, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's rope type.

    Non-default types (linear, llama3, yarn, ...) use transformers' own init functions,
    so their formulas are exactly the reference's.
    """
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, max_position: int, attention_scaling: float = 1.0) -> None:
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attention_scaling, persistent=False)
        self.rotary_dim = emb.shape[-1]
        # (positions, dtype, cos, sin) of the last call: every layer sharing this module gets
        # the same positions tensor in a forward pass, so only the first one gathers.
        self._last: tuple | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]."""
        last = self._last
        # Holding `positions` keeps its identity from being reused by a later tensor.
        # (The runner builds a new positions tensor for every pass and never writes into it.)
        if last is None or last[0] is not positions or last[1] != q.dtype:
            cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
            sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
            last = self._last = (positions, q.dtype, cos, sin)
        cos, sin = last[2], last[3]
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
