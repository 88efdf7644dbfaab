"""Async plumbing between engine streams and HTTP: SSE framing, merging several
request streams, and making sure a client that goes away aborts its requests.

Disconnects are the subtle part. Starlette cancels a StreamingResponse's body when the
client hangs up, but a generator suspended at `yield` is then never closed (only garbage
collected later); and nothing at all cancels a non-streaming handler. So streaming
responses close their body and run an abort callback themselves, and non-streaming work
runs next to a watcher of the ASGI `http.disconnect` message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event; compact JSON as OpenAI sends it."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def chunk_json(resp: Any) -> dict[str, Any]:
    """A stream chunk as OpenAI sends it: `usage` only when set, deltas without null keys."""
    data = resp.model_dump()
    if data.get("usage") is None:
        data.pop("usage", None)
    for choice in data.get("choices", []):
        if choice.get("prompt_logprobs", 0) is None:
            del choice["prompt_logprobs"]
        if isinstance(choice.get("delta"), dict):
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return data


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def run_until_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if not task.cancelled():
        return task.result()
    raise ClientDisconnected()


async def merge_async_iterators(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of all iterators as they come, tagged with the iterator's index. Closing the
    merged iterator (or an error in one) cancels and closes all the others. One task per
    iterator feeds a shared queue: the cost per item stays constant however many prompts."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                queue.put_nowait((i, item, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, _END, None))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        live = len(tasks)
        while live:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                live -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            for it in iterators:
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except Exception:  # noqa: S110 - best effort; the engine aborts on close
                        pass


_END = object()


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`first`, then the rest of the stream (after peeking at it). Closing closes `rest`."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()


async def peek_all(streams: Sequence[AsyncIterator[T]]) -> list[AsyncIterator[T]]:
    """Wait for every stream's first item (submitting all requests at once), so that
    validation errors surface before a 200 and its headers are sent. Returns streams that
    replay the first item; on any error all streams are closed and the first error raised."""
    results = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        with anyio.CancelScope(shield=True):
            for s in streams:
                aclose = getattr(s, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except Exception:  # noqa: S110 - already failed; closing is best effort
                        pass
        if isinstance(errors[0], StopAsyncIteration):
            raise RuntimeError("the engine ended a request stream without any output")
        raise errors[0]
    return [prepend(first, s) for first, s in zip(results, streams)]


class EngineStreamingResponse(StreamingResponse):
    """A text/event-stream response that, however it ends (done, client gone, error),
    closes its body generator and then runs `on_close` (which aborts unfinished requests)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        kwargs.setdefault("media_type", "text/event-stream")
        headers = dict(kwargs.pop("headers", None) or {})
        headers.setdefault("Cache-Control", "no-cache")
        super().__init__(content, headers=headers, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except Exception:  # noqa: S110 - the abort below still runs
                        pass
                await self._on_close()
