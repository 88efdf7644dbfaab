"""The messages between the engine core and its workers for one step: tokens and blocks, no
tensors, all of it msgspec-encodable (it crosses to worker processes)."""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.protocol import MultiModalFeature
from pagedllm.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers do not hold yet (first scheduled, or resumed after a preemption):
    sent whole, once."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int
    # A request resumed after a preemption brings its outputs so far (penalties, stop checks).
    output_token_ids: list[int] = []
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None
    mm_features: list[MultiModalFeature] = []  # its images (arrays included), in prompt order


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Requests the workers hold, as diffs: one entry per request in each list."""

    req_ids: list[str] = []
    # Tokens appended to the request since the workers last saw it (the sampled ones).
    new_token_ids: list[list[int]] = []
    new_block_ids: list[list[int]] = []  # appended to its block table
    # Authoritative: rejected drafts move it back.
    num_computed_tokens: list[int] = []


class SchedulerOutput(msgspec.Struct, omit_defaults=True, gc=False):
    """Self-contained plain data, so one msgspec encoding reaches every worker process; the
    in-process executor hands the same object over. Workers keep each request's state in their
    InputBatch and apply these diffs to it."""

    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    # req_id → tokens computed this step (drafts included), in the runner's row order.
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    # req_id → the drafts at the end of its scheduled tokens, verified this step.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    preempted_req_ids: set[str] = set()
    # Requests that finished since the last step, so the workers drop their state.
    finished_req_ids: set[str] = set()
    # (src, dst) block ids whose K/V the runner copies before the forward pass: the partial
    # last prompt block a sample of an n > 1 request forks from its sibling (copy-on-write).
    block_copies: list[tuple[int, int]] = []
    # req_id → indices of its images (mm_features) the workers encode this step, before the
    # forward pass; identifiers of encoder outputs they drop first (evicted from the encoder cache).
    scheduled_encoder_inputs: dict[str, list[int]] = {}
    free_encoder_mm_hashes: list[str] = []

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class GrammarOutput(msgspec.Struct, array_like=True, gc=False):
    """The step's structured-output bitmask: built by the engine core after `schedule()`, while
    the forward pass runs, and applied to the logits before sampling."""

    # req_id → its first row; a request verifying k drafts has k + 1 consecutive rows. Requests
    # without a grammar, or still reasoning, have none (all tokens allowed).
    structured_output_request_ids: dict[str, int]
    grammar_bitmask: Any  # [rows, ceil(vocab / 32)] int32 bitmask of the allowed next tokens


# (token ids, logprobs, rank of the first id): the first id is the sampled / actual token,
# followed by the top-k.
LogprobsEntry = tuple[list[int], list[float], int]


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Only the driver rank's goes back to the engine core."""

    req_ids: list[str]
    # The new tokens of each scheduled request (accepted drafts, then one sampled token), or
    # None for a partial prefill chunk.
    sampled_token_ids: list[list[int] | None]
    # Per request, one entry per new token, when it asked for logprobs and sampled this step.
    logprobs: list[list[LogprobsEntry] | None] | None = None
    # req_id → entries for the prompt positions this chunk covered (prompt_logprobs).
    prompt_logprobs: dict[str, list[LogprobsEntry]] = {}
    # Speculative decoding: the drafts proposed for each request's next step (None: none).
    spec_token_ids: list[list[int] | None] | None = None
    # Pooling requests whose prompt this step completed: their vectors (None for the others).
    pooler_output: list[list[float] | None] | None = None
