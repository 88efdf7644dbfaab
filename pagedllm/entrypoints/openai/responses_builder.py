"""One response's output items and stream events, built from the chat parsers' deltas.

Streaming and non-streaming responses both run through this builder (the JSON body is its
final state), so the openai SDK's stream helper assembles exactly the non-streaming body.
An event's `sequence_number` is its index in `events`, so `starting_after=N` is a slice."""

from __future__ import annotations

import copy
import time
from typing import Any

from pagedllm.entrypoints.openai.protocol import DeltaMessage
from pagedllm.entrypoints.openai.responses_items import new_id

TERMINAL = ("completed", "incomplete", "failed", "cancelled")
# The request's own structures the response echoes: never changed after the response is made, so
# snapshots share them rather than deep-copy what a client may nest deeply.
_ECHOED = frozenset({"text", "tools", "tool_choice", "metadata", "reasoning"})


def output_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


class ResponseBuilder:
    def __init__(self, response: dict[str, Any], events: list[dict[str, Any]] | None = None) -> None:
        self.response = response
        self.events = events if events is not None else []
        self._item: dict[str, Any] | None = None  # the output item being written
        self._call_index: int | None = None  # the parser's index of the function call being written

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": len(self.events), **fields}
        self.events.append(event)
        return event

    def snapshot(self) -> dict[str, Any]:
        return {k: v if k in _ECHOED else copy.deepcopy(v) for k, v in self.response.items()}

    def set_status(self, status: str, event: str | None = None) -> None:
        self.response["status"] = status
        if event is not None:
            self.emit(event, response=self.snapshot())

    # ---- deltas -------------------------------------------------------------
    def add(self, delta: DeltaMessage, logprobs: list[dict[str, Any]] | None = None) -> None:
        """One parsed delta; `logprobs`: the output_text tokens' (OpenAI's shape), when asked for."""
        if delta.reasoning_content:
            item = self._open("reasoning")
            item["content"][0]["text"] += delta.reasoning_content
            self.emit("response.reasoning_text.delta", item_id=item["id"], output_index=self._index(),
                      content_index=0, delta=delta.reasoning_content)
        if delta.content:
            item = self._open("message")
            item["content"][0]["text"] += delta.content
            item["content"][0]["logprobs"] += logprobs or []
            self.emit("response.output_text.delta", item_id=item["id"], output_index=self._index(),
                      content_index=0, delta=delta.content, logprobs=logprobs or [])
        for call in delta.tool_calls or []:
            if call.id is not None or self._call_index != call.index:
                self._close()
                self._call_index = call.index
                name = call.function.name if call.function else None
                self._start({"id": new_id("fc"), "type": "function_call", "call_id": call.id or new_id("call"),
                             "name": name or "", "arguments": "", "status": "in_progress"})
            args = call.function.arguments if call.function else None
            if args:
                self._item["arguments"] += args
                self.emit("response.function_call_arguments.delta", item_id=self._item["id"],
                          output_index=self._index(), delta=args)

    def _index(self) -> int:
        return len(self.response["output"]) - 1

    def _open(self, kind: str) -> dict[str, Any]:
        if self._item is not None and self._item["type"] == kind:
            return self._item
        self._close()
        if kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        part = item["content"].pop()
        self._start(item)
        item["content"].append(part)
        self.emit("response.content_part.added", item_id=item["id"], output_index=self._index(), content_index=0,
                  part=copy.deepcopy(part))
        return item

    def _start(self, item: dict[str, Any]) -> None:
        self.response["output"].append(item)
        self._item = item
        self.emit("response.output_item.added", output_index=self._index(), item=copy.deepcopy(item))

    def _close(self, status: str = "completed") -> None:
        item, self._item, self._call_index = self._item, None, None
        if item is None:
            return
        index = self.response["output"].index(item)
        if item["type"] == "function_call":
            self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            kind = "output_text" if part["type"] == "output_text" else "reasoning_text"
            extra = {"logprobs": part["logprobs"]} if kind == "output_text" else {}
            self.emit(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=0,
                      text=part["text"], **extra)
            self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=copy.deepcopy(part))
        item["status"] = status
        self.emit("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    # ---- the end --------------------------------------------------------------
    def finish(self, status: str, *, incomplete_reason: str | None = None, error: dict[str, Any] | None = None,
               usage: dict[str, Any] | None = None) -> None:
        """Close the open item and emit the terminal event (none for a cancelled response)."""
        self._close("completed" if status == "completed" else "incomplete")
        r = self.response
        r["status"] = status
        r["incomplete_details"] = {"reason": incomplete_reason} if incomplete_reason else None
        r["error"] = error
        if usage is not None:
            r["usage"] = usage
        r["output_text"] = output_text(r)
        if status == "completed":
            r["completed_at"] = int(time.time())
        if status != "cancelled":
            self.emit(f"response.{status}", response=self.snapshot())
