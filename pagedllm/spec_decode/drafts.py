"""The scheduler's side of speculative decoding: lookahead slots for a draft model's proposals,
and which proposals a request may take."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.config import SpeculativeConfig
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import StructuredOutputManager


class DraftingRequest(Protocol):
    """What the draft rules read of a scheduler's request (`core.request.Request`)."""

    max_tokens: int
    num_output_tokens: int
    num_tokens: int
    sampling_params: SamplingParams
    structured_output: Any  # its grammar's matcher, or None


def num_lookahead_slots(num_lookahead_tokens: int, max_model_len: int, num_tokens_after_step: int) -> int:
    """Slots for a draft model's proposals; none past max_model_len, where it never proposes
    (so a KV cache that holds max_model_len tokens is always enough)."""
    return min(num_lookahead_tokens, max(0, max_model_len - num_tokens_after_step))


def admissible_drafts(
    request: DraftingRequest,
    drafts: list[int],
    max_model_len: int,
    speculative_config: SpeculativeConfig,
    structured_output_manager: StructuredOutputManager,
) -> list[int]:
    """No more drafts than the request may still produce tokens (max_tokens, max_model_len),
    and with a grammar only the prefix it accepts.

    Cutting at the first draft the grammar refuses is lossless only when the draft is certain
    (n-gram, or a greedy request); a sampled draft from a draft model is left to the
    verification, which rejects it and resamples from the residual distribution.
    """
    room = min(request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens) - 1
    drafts = drafts[: max(room, 0)]
    so = request.structured_output
    certain = speculative_config.method == "ngram" or request.sampling_params.greedy
    if so is not None and drafts and certain:
        drafts = structured_output_manager.valid_prefix(so, drafts)
    return drafts
