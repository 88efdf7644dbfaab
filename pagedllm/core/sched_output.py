"""What the scheduler tells the model runner for one step: tokens and blocks, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    req_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table
    sample: bool  # does this chunk reach the end of the known tokens?
    sampling_params: SamplingParams
    # Live references to the request's token lists (same process: no copy).
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests that finished since the last step, so the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: [n, vocab/32] int32 bitmask of allowed next tokens, req_id → row.
    grammar_bitmask: Any = None
    grammar_rows: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# (token ids, logprobs, rank of the first id): the first id is the sampled / actual token,
# followed by the top-k.
LogprobsEntry = tuple[list[int], list[float], int]


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    # One sampled token per scheduled request, or None for a partial prefill chunk.
    sampled_token_ids: list[int | None]
    # Per request, when it asked for logprobs and sampled this step.
    logprobs: list[LogprobsEntry | None] | None = None
    # req_id → entries for the prompt positions this chunk covered (prompt_logprobs).
    prompt_logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
