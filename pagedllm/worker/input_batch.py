"""The worker's persistent view of its requests (vLLM's InputBatch), kept up to date from the
step messages: a request arrives whole once (`NewRequestData`), then only as diffs
(`CachedRequestData`), and is dropped when it finishes or is preempted.

Every rank holds the same states, so every rank builds the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedllm.core.sched_output import NewRequestData, SchedulerOutput
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # tokens with K/V in the cache before this step
    output_token_ids: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None
    # A step's part, in the row `InputBatch.update_states` makes for it:
    token_ids: list[int] = field(default_factory=list)  # the tokens to compute (drafts last)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify
    sample: bool = False  # does this step reach the end of the known tokens?

    @property
    def start_pos(self) -> int:
        return self.num_computed_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two lists."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


class InputBatch:
    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}

    def update_states(self, sched: SchedulerOutput) -> list[CachedRequestState]:
        """Apply one step message; returns the step's requests in row order."""
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in sched.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self.requests[new.req_id] = _from_new(new)
        cached = sched.scheduled_cached_reqs
        for req_id, tokens, blocks, computed in zip(cached.req_ids, cached.new_token_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            state = self.requests[req_id]
            state.output_token_ids.extend(tokens)
            state.block_ids.extend(blocks)
            state.num_computed_tokens = computed
        rows = []
        drafts = sched.scheduled_spec_decode_tokens
        for req_id, n in sched.num_scheduled_tokens.items():
            state = self.requests[req_id]
            spec = drafts.get(req_id, [])
            start = state.num_computed_tokens
            end = start + n - len(spec)
            tokens = state.token_slice(start, end)
            # A row of its own (sharing the state's lists): with steps in flight (pipeline
            # parallel) the next message may move the state on before this step samples.
            rows.append(replace(state, token_ids=tokens + spec if spec else tokens, spec_token_ids=spec,
                                sample=end >= state.num_tokens))
        return rows


def _from_new(new: NewRequestData) -> CachedRequestState:
    return CachedRequestState(new.req_id, new.prompt_token_ids, new.sampling_params, list(new.block_ids),
                              new.num_computed_tokens, list(new.output_token_ids), new.pooling_params,
                              new.token_type_ids, new.lora_request)
