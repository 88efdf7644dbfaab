"""What one can do with a response after creating it: retrieve it (or replay its stream from
`starting_after`), cancel it, delete it, list its input items, and submit the outputs of the
functions it called, which resumes the same response with the model's next turn."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.responses_builder import ResponseBuilder
from pagedllm.entrypoints.openai.responses_items import new_id, normalize_item, pending_calls
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, ToolOutputsRequest
from pagedllm.entrypoints.openai.responses_session import ResponseSession, follow, replay
from pagedllm.entrypoints.openai.responses_store import StoredResponse
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses


def page(items: list[dict[str, Any]], *, limit: int, order: str, after: str | None) -> dict[str, Any]:
    """OpenAI's cursor page over items: `limit` of them in `order`, starting after the item `after`."""
    if not 1 <= limit <= 100:
        raise OpenAIError("limit must be between 1 and 100", param="limit")
    if order not in ("asc", "desc"):
        raise OpenAIError("order must be asc or desc", param="order")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise OpenAIError(f"after: no item with id {after!r}", param="after")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0].get("id") if data else None,
            "last_id": data[-1].get("id") if data else None, "has_more": len(ordered) > limit}


class OpenAIServingStoredResponses:
    def __init__(self, responses: OpenAIServingResponses, max_tool_output_bytes: int) -> None:
        self.responses = responses
        self.registry = responses.registry
        self.max_tool_output_bytes = max_tool_output_bytes

    async def retrieve(self, response_id: str, stream: bool, starting_after: int | None) -> Response:
        found = self.registry.find(response_id)
        if not stream:
            snapshot = found.builder.snapshot() if isinstance(found, ResponseSession) else found.response
            return JSONResponse(snapshot)
        after = -1 if starting_after is None else starting_after
        body = follow(found, after) if isinstance(found, ResponseSession) else replay(found.events, after)
        return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def cancel(self, response_id: str) -> dict[str, Any]:
        found = self.registry.find(response_id)
        response = found.response
        if not response.get("background"):
            raise OpenAIError("Only background responses can be cancelled.", param="response_id")
        if isinstance(found, ResponseSession) and found.task is not None and not found.task.done():
            found.task.cancel()
            await asyncio.gather(found.task, return_exceptions=True)  # the engine request is aborted by then
            return found.builder.snapshot()
        return response

    async def delete(self, response_id: str) -> dict[str, Any]:
        live = self.registry.get_live(response_id)
        if live is not None and live.task is not None and not live.task.done():
            live.task.cancel()
            await asyncio.gather(live.task, return_exceptions=True)
        deleted = self.registry.store is not None and self.registry.store.delete(response_id)
        if not deleted and live is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404, param="response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def input_items(self, response_id: str, *, limit: int, order: str, after: str | None) -> dict[str, Any]:
        found = self.registry.find(response_id)
        return page(found.input_items, limit=limit, order=order, after=after)

    async def submit_tool_outputs(self, response_id: str, body: ToolOutputsRequest) -> dict[str, Any]:
        """Record function outputs; once every call of the response has one, generate the model's
        next turn into the same response (its stream continues: GET ?stream=true&starting_after=N).
        A forced tool_choice (required, named) turns to auto for that turn, as agent loops reset it."""
        found = self.registry.find(response_id)
        if isinstance(found, ResponseSession):
            raise OpenAIError("the response is still in progress; submit tool outputs once it has ended",
                              param="response_id")
        outputs = _outputs_of(body)
        pending = pending_calls(found.history)
        items = []
        for call_id, output in outputs:
            size = len(json.dumps(output, ensure_ascii=False).encode())
            if size > self.max_tool_output_bytes:
                raise OpenAIError(f"tool output for {call_id!r} is {size} bytes, over this server's limit of "
                                  f"{self.max_tool_output_bytes} (--max-tool-output-bytes)", param="output")
            if call_id not in pending:
                raise OpenAIError(f"no function call {call_id!r} of this response is waiting for an output; "
                                  f"waiting: {pending}", param="tool_call_id")
            items.append(normalize_item({"type": "function_call_output", "call_id": call_id, "output": output,
                                         "id": new_id("fco")}, "output"))
            pending.remove(call_id)
        record = StoredResponse(response=found.response, input_items=found.input_items + items,
                                history=found.history + items, events=found.events, request=found.request,
                                created_at=found.created_at)
        if pending:
            self.registry.store.put(record)
            return {"id": response_id, "status": record.response["status"], "pending_tool_calls": pending}
        await self._resume(record, items)
        return {"id": response_id, "status": "in_progress", "pending_tool_calls": []}

    async def _resume(self, record: StoredResponse, new_items: list[dict[str, Any]]) -> None:
        request = ResponsesRequest.model_validate(record.request)
        if request.tool_choice not in (None, "auto", "none"):  # a forced call would only call again
            chat = self.responses.chat
            auto = chat.enable_auto_tool_choice and chat.tool_parser_cls is not None
            request.tool_choice = "auto" if auto else "none"
        response = record.response
        response.update(status="in_progress", completed_at=None, incomplete_details=None, error=None)
        conv = response.get("conversation") or {}
        session = ResponseSession(ResponseBuilder(response, list(record.events)), record.input_items,
                                  record.history, record.request, True, conversation_id=conv.get("id"),
                                  turn_input=new_items, output_start=len(response["output"]))
        session, prompt, params, parser_args = await self.responses.prepare(request, session=session)
        self.responses.start(session, prompt, params, parser_args, request)


def _outputs_of(body: ToolOutputsRequest) -> list[tuple[str, Any]]:
    outputs = [(o.tool_call_id or o.call_id, o.output) for o in body.tool_outputs or []]
    if body.tool_call_id is not None or body.output is not None:
        outputs.append((body.tool_call_id, body.output))
    if not outputs or any(not call_id or output is None for call_id, output in outputs):
        raise OpenAIError("give tool_call_id and output, or tool_outputs: [{tool_call_id, output}, ...]",
                          param="tool_outputs")
    return outputs
