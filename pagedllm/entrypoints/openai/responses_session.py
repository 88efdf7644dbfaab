"""Live responses: a ResponseSession per response being generated (its builder, its producer
task, its waiting readers), and the registry that finds a response live or in the store.

Every response, streamed or not, is produced by one task writing into its session; HTTP
answers are readers of the session. So a background response can be polled, replayed from
any `starting_after`, and cancelled, and a reader that goes away never loses the events."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.responses_builder import TERMINAL, ResponseBuilder
from pagedllm.entrypoints.openai.responses_store import ResponseStore, StoredResponse


@dataclass(slots=True)
class ResponseSession:
    builder: ResponseBuilder
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]  # the items before this response's output: what the model saw
    request: dict[str, Any]  # the request body, to resume after tool outputs
    store: bool
    conversation_id: str | None = None
    turn_input: list[dict[str, Any]] | None = None  # the items new in this turn (None: input_items)
    output_start: int = 0  # the first output item of this turn (a resumed response keeps the earlier ones)
    task: asyncio.Task | None = None
    created: float = field(default_factory=time.time)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def response(self) -> dict[str, Any]:
        return self.builder.response

    @property
    def id(self) -> str:
        return self.builder.response["id"]

    @property
    def done(self) -> bool:
        return self.response["status"] in TERMINAL

    def notify(self) -> None:
        """Wake the readers waiting for new events."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self) -> None:
        await self._changed.wait()

    def new_output(self) -> list[dict[str, Any]]:
        return self.response["output"][self.output_start:]

    def record(self) -> StoredResponse:
        return StoredResponse(response=self.builder.snapshot(), input_items=list(self.input_items),
                              history=self.history + self.new_output(), events=list(self.builder.events),
                              request=self.request)


def sse_event(event: dict[str, Any]) -> str:
    """OpenAI's framing of a Responses event: its type as the SSE event name, then the JSON."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


async def follow(session: ResponseSession, starting_after: int = -1) -> AsyncIterator[str]:
    """The session's events after `starting_after`, then each new one as it comes, until the end."""
    i = max(starting_after + 1, 0)
    while True:
        events = session.builder.events
        while i < len(events):
            yield sse_event(events[i])
            i += 1
        if session.done:  # the terminal event is the last one a session writes
            return
        await session.wait()


async def replay(events: list[dict[str, Any]], starting_after: int = -1) -> AsyncIterator[str]:
    for event in events[max(starting_after + 1, 0):]:
        yield sse_event(event)


class ResponseRegistry:
    """Live sessions by id, then the store. Stored records are written when a response ends;
    a background response past the store's TTL is cancelled (its KV blocks freed) and dropped."""

    def __init__(self, store: ResponseStore | None, ttl: float | None) -> None:
        self.store = store
        self.ttl = ttl
        self.live: dict[str, ResponseSession] = {}

    def add(self, session: ResponseSession) -> None:
        self.sweep()
        if session.store:
            self.live[session.id] = session

    def sweep(self) -> None:
        if self.ttl is None:
            return
        now = time.time()
        for rid, session in list(self.live.items()):
            if now - session.created > self.ttl:
                del self.live[rid]
                if session.task is not None and not session.task.done():
                    session.task.cancel()

    def get_live(self, response_id: str) -> ResponseSession | None:
        self.sweep()
        return self.live.get(response_id)

    def get_stored(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id) if self.store is not None else None

    def find(self, response_id: str) -> ResponseSession | StoredResponse:
        found = self.get_live(response_id) or self.get_stored(response_id)
        if found is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404, param="response_id")
        return found

    def finished(self, session: ResponseSession) -> None:
        """Persist a session that reached a terminal state, then forget it."""
        if session.store and self.store is not None and self.live.get(session.id) is session:
            self.store.put(session.record())
        if self.live.get(session.id) is session:
            del self.live[session.id]
        session.notify()
