"""What `LLM.generate` returns (the vLLM `RequestOutput` shape), and what `LLM.encode` / `LLM.embed`
return (`PoolingRequestOutput`, `EmbeddingRequestOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = field(default=None)


@dataclass(slots=True)
class PoolingOutput:
    data: list[float]  # the pooled vector


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # one per label: softmax, or a sigmoid with a single label

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class PoolingRequestOutput:
    """One pooling request's result; `outputs` is a PoolingOutput here, and the task's view of
    the same vector in the subclasses (`from_base`)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> Any:
        return cls(out.request_id, cls.output_type(out.outputs.data), out.prompt_token_ids, out.finished)


@dataclass(slots=True)
class EmbeddingRequestOutput(PoolingRequestOutput):
    output_type = EmbeddingOutput


@dataclass(slots=True)
class ClassificationRequestOutput(PoolingRequestOutput):
    output_type = ClassificationOutput


@dataclass(slots=True)
class ScoringRequestOutput(PoolingRequestOutput):
    """`prompt_token_ids`: both texts' tokens."""
