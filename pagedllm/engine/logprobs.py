"""Logprob records in vLLM's shape: per position, token id → Logprob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


def make_logprobs_dict(
    entry: tuple[list[int], list[float], int], tokenizer: Any | None
) -> dict[int, Logprob]:
    """The chosen token (with its true rank) first, then the top-k ranked 1..k."""
    ids, vals, chosen_rank = entry

    def decode(tok: int) -> str | None:
        return tokenizer.decode([tok]) if tokenizer is not None else None

    out = {ids[0]: Logprob(vals[0], chosen_rank, decode(ids[0]))}
    for rank, (tok, val) in enumerate(zip(ids[1:], vals[1:]), start=1):
        if tok not in out:
            out[tok] = Logprob(val, rank, decode(tok))
    return out
