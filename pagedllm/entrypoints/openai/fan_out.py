"""Bounding what one request with many prompts asks of the engine: the total sequences it
may start (prompts x samples), and how many of its prompts run at once, so that a large batch
request does not hold the scheduler's queue ahead of requests that arrive after it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, TypeVar

from pagedllm.entrypoints.openai.errors import OpenAIError

T = TypeVar("T")


def scheduler_limits(engine: Any) -> tuple[int | None, int]:
    """(max_sequences_per_request or None for no limit, max_num_seqs) from the engine's config."""
    sched = getattr(getattr(engine, "config", None), "scheduler_config", None)
    return getattr(sched, "max_sequences_per_request", None), getattr(sched, "max_num_seqs", 256)


def check_sequences(num_prompts: int, samples: int, limit: int | None) -> None:
    """A 400 naming --max-sequences-per-request when prompts x samples exceed it."""
    if limit is not None and num_prompts * samples > limit:
        raise OpenAIError(f"this request asks for {num_prompts} prompt(s) x {samples} sample(s) = "
                          f"{num_prompts * samples} sequences; the server's limit is {limit} "
                          "(--max-sequences-per-request): send fewer prompts or samples per request",
                          param="prompt" if num_prompts > 1 else "n")


def window(samples: int, max_num_seqs: int) -> int:
    """Prompts of one request in the engine at once: about one full batch of sequences, so
    the engine stays busy while later requests queue behind at most that much."""
    return max(1, max_num_seqs // max(1, samples))


async def gated(stream: AsyncIterator[T], slots: asyncio.Semaphore) -> AsyncIterator[T]:
    """`stream`, started only once one of the request's slots is free; the slot is held
    until it ends. Slots are handed out first come, first served: prompts run in order."""
    async with slots, aclosing(stream):  # type: ignore[type-var]
        async for item in stream:
            yield item


def feed_gradually(streams: list[AsyncIterator[T]], samples: int, max_num_seqs: int) -> list[AsyncIterator[T]]:
    """The streams, gated so that at most `window` of them are in the engine at once."""
    size = window(samples, max_num_seqs)
    if len(streams) <= size:
        return streams
    slots = asyncio.Semaphore(size)
    return [gated(s, slots) for s in streams]
