"""Engine-side state of one request: tokens known vs tokens computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.kv_cache_utils import BlockHash
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.protocol import EngineCoreRequest, MultiModalFeature
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FSM = 6  # its grammar is still compiling
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return RequestStatus.FINISHED_STOPPED <= status <= RequestStatus.FINISHED_ABORTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # The scheduler's only notion of progress: prefill, chunked prefill and decode
    # are all "num_computed_tokens catching up to num_tokens".
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit length at first schedule
    num_preemptions: int = 0
    first_token_time: float | None = None  # when its first output token was sampled (wall clock)
    first_scheduled_time: float | None = None  # wall clock; the front's queue and prefill times need it
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Accumulated over prefill chunks; handed out with the first output token.
    prompt_logprobs: list | None = None
    # Requests of the same parent (n > 1) share a group: siblings wait for the first
    # one's prompt to be cached, then reuse its blocks.
    group_id: str | None = None
    structured_output: Any = None  # StructuredOutputRequest while it has a grammar
    # Proposed by the drafter after the last step, verified by the next forward pass.
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: tokens sampled by steps in flight, not appended yet. The next step
    # computes them where they will be (the workers know them by then).
    num_output_placeholders: int = 0
    # How much of the request its workers hold: tokens and block ids sent in step messages
    # (0 tokens: none; it is sent whole when next scheduled).
    num_synced_tokens: int = 0
    num_synced_blocks: int = 0
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None
    # A multimodal prompt's images, in prompt order; their encoder outputs are scheduled with the
    # first step that reaches their placeholders (Scheduler._schedule_encoder_inputs).
    mm_features: list[MultiModalFeature] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def mm_spans(self) -> list[tuple[int, int, str]]:
        """(offset, length, identifier) of each image: what the prefix-cache hashes key on."""
        return [(f.offset, f.length, f.identifier) for f in self.mm_features]

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_ids=frozenset(req.eos_token_ids),
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            group_id=req.group_id,
            pooling_params=req.pooling_params,
            token_type_ids=req.token_type_ids,
            lora_request=req.lora_request,
            mm_features=list(req.mm_features or ()),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens or 1 << 62

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)
