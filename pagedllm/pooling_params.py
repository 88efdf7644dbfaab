"""PoolingParams: what a pooling request (embed, encode) asks of the pooled hidden states, in
vLLM's names. Plain data, so it crosses process boundaries with the request."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "encode")


@dataclass
class PoolingParams:
    # None: the model's default (its pooler config; sentence-transformers models say in modules.json).
    normalize: bool | None = None
    # Matryoshka truncation of an embedding to its first `dimensions` values (then normalized).
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
