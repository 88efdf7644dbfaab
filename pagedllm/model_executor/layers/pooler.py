"""Pooling: one vector per prompt from its tokens' hidden states (MEAN, CLS or LAST), then the
request's normalization and matryoshka truncation. All requests of a step at once."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, cu_start: np.ndarray, cu_end: np.ndarray, pooling_type: str) -> torch.Tensor:
    """[R, hidden] float32 for the R prompts at hidden[cu_start[i]:cu_end[i]] of the packed batch."""
    dev = hidden.device
    if pooling_type == "CLS":
        return hidden[torch.from_numpy(cu_start).to(dev)].float()
    if pooling_type == "LAST":
        return hidden[torch.from_numpy(cu_end - 1).to(dev)].float()
    lens = torch.from_numpy(cu_end - cu_start).to(dev)
    owner = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens)
    rows = hidden[int(cu_start[0]) : int(cu_end[-1])].float()
    sums = torch.zeros(len(lens), hidden.shape[-1], dtype=torch.float32, device=dev).index_add_(0, owner, rows)
    return sums / lens[:, None]


def finish_vectors(pooled: torch.Tensor, normalize: list[bool], dimensions: list[int | None]) -> list[list[float]]:
    """Each row truncated to its `dimensions` (if any), then L2-normalized if asked. On the host:
    one copy from a GPU, not a normalization and a copy per row."""
    out = []
    for row, norm, dims in zip(pooled.cpu(), normalize, dimensions):
        if dims is not None:
            row = row[:dims]
        out.append((F.normalize(row, dim=-1) if norm else row).tolist())
    return out
