"""Messages between the front end and the engine core."""

from __future__ import annotations

import msgspec


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request after one step; plain data so it can cross a process boundary."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # One (token ids, logprobs, rank) per new token: the sampled token first, then the top-k.
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # Sent with the first token: one entry per prompt token after the first.
    prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
