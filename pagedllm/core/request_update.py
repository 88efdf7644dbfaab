"""Applying one step's model output to a request: draft rollback, token append, stop checks.

Plain functions over a `Request`, apart from the `Scheduler`, which keeps the queues, the
token budget, preemption and KV allocation and calls these from `update_from_output`.
"""

from __future__ import annotations

import time

from pagedllm.core.request import Request, RequestStatus
from pagedllm.protocol import EngineCoreOutput
from pagedllm.spec_decode.metrics import SpecDecodingStats


def update_request_with_output(
    request: Request,
    tokens: list[int],
    num_drafts: int,
    logprobs: list | None,
    max_model_len: int,
    stats: SpecDecodingStats,
) -> tuple[EngineCoreOutput, bool]:
    """Roll back rejected drafts, append the sampled tokens (the accepted drafts and one more)
    and say whether the request stopped, with the output the frontend gets for this step."""
    if num_drafts:
        # Rejected drafts leave num_computed_tokens; later steps rewrite their slots, and the
        # block hashes cached after this only cover tokens that are part of the sequence.
        request.num_computed_tokens -= num_drafts - (len(tokens) - 1)
        stats.observe(num_drafts, len(tokens) - 1)
    first = request.num_output_tokens == 0
    if first:
        request.first_token_time = time.time()
    new_tokens, stopped = append_output_tokens(request, tokens, max_model_len)
    output = EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_tokens,
        finish_reason=request.get_finished_reason(),
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        new_logprobs=logprobs[: len(new_tokens)] if logprobs is not None else None,
        prompt_logprobs=request.prompt_logprobs if first else None,
        scheduled_time=request.first_scheduled_time if first else None,
    )
    return output, stopped


def append_output_tokens(request: Request, tokens: list[int], max_model_len: int) -> tuple[list[int], bool]:
    """Append one by one; tokens after a stop are dropped."""
    for i, token in enumerate(tokens):
        request.append_output_token_ids(token)
        stopped = check_stop(request, token, max_model_len)
        so = request.structured_output
        if so is not None and not stopped:
            # A complete grammar ends the request (it would only allow stop tokens now).
            if not so.accept_token(token):
                request.status = RequestStatus.FINISHED_STOPPED
                stopped = True
        if stopped:
            return tokens[: i + 1], True
    return tokens, False


def check_stop(request: Request, token: int, max_model_len: int) -> bool:
    """Length first (as vLLM): an EOS that is also the last allowed token is "length"."""
    params = request.sampling_params
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
            return True
    return False
