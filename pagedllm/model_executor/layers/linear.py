"""Linear layers whose parameters know how to load their checkpoint shards.

Separate q/k/v (and gate/up) matrices of a checkpoint are stacked into one weight
so each is a single GEMM; the `weight_loader` on the parameter puts each shard
in its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.layers.cpu_gemm import packed_linear
from pagedllm.model_executor.layers.quantization import WeightOnlyQuant


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant: WeightOnlyQuant | None = None  # set by loader/quantize.py; runs few rows
        self.packed: torch.Tensor | None = None  # set by loader/cpu_pack.py; replaces the weight
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None and x.numel() <= self.quant.max_rows * self.in_features:
            return self.quant(x, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several checkpoint matrices with the same input, stacked along the output dim."""

    def __init__(self, in_features: int, shard_sizes: dict[str | int, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.weight.weight_loader = self._load_shard
        if bias:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int) -> None:
        offset, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"shard {shard_id!r}: expected {tuple(target.shape)}, checkpoint has {tuple(loaded.shape)}"
            )
        target.copy_(loaded)


class QKVLinear(MergedLinear):
    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(
            hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias
        )
