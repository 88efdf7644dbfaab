"""Rotary position embedding with a precomputed cos/sin table (neox / rotate-half style)."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.custom_op import platform_of
from pagedllm.model_executor.layers import cpu_kernels

logger = logging.getLogger(__name__)


def compute_inv_freq(
    config: Any, head_dim: int, layer_type: str | None = None, max_model_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's rope type.

    Non-default types (linear, llama3, yarn, ...) use transformers' own init functions,
    so their formulas are exactly the reference's; LongRoPE's factor set depends on
    `max_model_len` (see `longrope_inv_freq`).
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
    if rope_type in ("longrope", "su"):
        return longrope_inv_freq(config, params, head_dim, max_model_len)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
    return inv_freq.float(), float(scaling)


def longrope_inv_freq(
    config: Any, params: dict, head_dim: int, max_model_len: int | None
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3's "longrope" / "su"): each frequency divided by its own factor, from the short
    set for contexts up to original_max_position_embeddings, the long set beyond; cos/sin scaled by
    the attention factor, sqrt(1 + ln(s) / ln(original)) for s = max_position / original unless set.

    One set serves every position, the long one iff max_model_len exceeds the original length: keys
    stay in the KV cache (and the prefix cache) under the set they were rotated with, so a switch
    within a sequence would mix the two. transformers instead recomputes a whole sequence with the
    long set once it grows past the original length; the two agree on every sequence when
    max_model_len <= original, and on prompts longer than original otherwise.
    Without max_model_len: the short set, as transformers starts."""
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None) or config.max_position_embeddings
    scale = params.get("factor") or config.max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
    which = "long_factor" if max_model_len is not None and max_model_len > original else "short_factor"
    if max_model_len is not None:
        logger.info("LongRoPE: the %s set for max_model_len %d (original_max_position_embeddings %d)",
                    which, max_model_len, original)
    factors = torch.tensor(params[which], dtype=torch.float32)
    if factors.numel() != dim // 2:
        raise ValueError(f"rope {which} has {factors.numel()} entries; the rotary dimension {dim} needs {dim // 2}")
    inv_freq = 1.0 / (factors * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention)


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
            cos, sin = self._gather(positions)
            last = self._last = (positions, q.dtype, cos.to(q.dtype).unsqueeze(1), sin.to(q.dtype).unsqueeze(1))
        cos, sin = last[2], last[3]
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)

    def _gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, rotary_dim] at the positions."""
        return self.cos_cache[positions], self.sin_cache[positions]

    def forward_qkv(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ([T, heads, D]) from a fused projection [T, (Hq + 2 Hk) D]: the per-head
        q/k norms (when given) and the rotation. On CPU one C kernel does both, in place of
        ~25 small ops per layer."""
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        v = qkv[:, q_size + kv_size :].view(-1, num_kv_heads, head_dim)
        norms = None
        fused = self._fused_ok(qkv, positions, head_dim)
        if fused and q_norm is not None:
            q_w, k_w = q_norm.kernel_weight(qkv), k_norm.kernel_weight(qkv)
            fused = q_w is not None and k_w is not None and type(q_norm) is type(k_norm) and q_norm.eps == k_norm.eps
            norms = (q_w, k_w, q_norm.eps, q_norm.gemma_style)
        if fused:
            q, k = cpu_kernels.qk_norm_rope(
                qkv, num_heads, num_kv_heads, head_dim, norms, self.cos_cache, self.sin_cache, positions
            )
            return q, k, v
        q = qkv[:, :q_size].view(-1, num_heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(-1, num_kv_heads, head_dim)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = self(positions, q, k)
        return q, k, v

    def _fused_ok(self, qkv: torch.Tensor, positions: torch.Tensor, head_dim: int) -> bool:
        return (
            positions.dim() == 1
            and qkv.dim() == 2
            and qkv.stride(1) == 1
            and self.rotary_dim % 32 == 0
            and self.rotary_dim <= head_dim <= 1024
            and self.cos_cache.dtype == torch.float32
            and positions.dtype == torch.int64
            and positions.is_contiguous()
            and platform_of(qkv) == "cpu"
        )


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL): positions [3, T] (temporal, height, width) rotate three
    sections of the frequencies (`mrope_section`, summing to rotary_dim / 2), each by its own
    stream. Text tokens have three equal positions, which is plain RoPE: the runner passes [T]
    positions for steps without image tokens, and those take the parent's paths (the fused C
    kernel, the decode plans)."""

    def __init__(self, inv_freq: torch.Tensor, max_position: int, attention_scaling: float,
                 mrope_section: list[int]) -> None:
        super().__init__(inv_freq, max_position, attention_scaling)
        if sum(mrope_section) * 2 != self.rotary_dim:
            raise ValueError(f"mrope_section {mrope_section} does not cover the rotary dimension {self.rotary_dim}")
        stream = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(mrope_section)])
        self.register_buffer("stream", torch.cat((stream, stream)), persistent=False)

    def _gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super()._gather(positions)
        cols = torch.arange(self.rotary_dim, device=positions.device)[:, None]
        rows = positions[self.stream]  # [rotary_dim, T]: each frequency's position stream
        return self.cos_cache[rows, cols].t(), self.sin_cache[rows, cols].t()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
