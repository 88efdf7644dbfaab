"""The routes of the Responses and Conversations APIs, added to the app by build_app.
`serve` is the app's wrapper that turns any failure into an OpenAI error body."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.openapi import responses
from pagedllm.entrypoints.openai.responses_protocol import (
    ConversationCreateRequest,
    ConversationItemsRequest,
    ConversationObject,
    ConversationUpdateRequest,
    DeletedObject,
    ItemList,
    ResponseObject,
    ResponsesRequest,
    ToolOutputsAccepted,
    ToolOutputsRequest,
)
from pagedllm.entrypoints.openai.serving_conversations import OpenAIServingConversations
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_stored_responses import OpenAIServingStoredResponses

Serve = Callable[[Awaitable[Any]], Awaitable[Any]]


def _json(value: Any) -> Awaitable[Response]:
    async def work() -> Response:
        return JSONResponse(value() if callable(value) else await value)
    return work()


def add_responses_routes(app: FastAPI, created: OpenAIServingResponses, stored: OpenAIServingStoredResponses,
                         conversations: OpenAIServingConversations, serve: Serve) -> None:
    errors = (400, 401, 404, 413, 503)

    @app.post("/v1/responses", responses=responses(ResponseObject, *errors, stream=True))
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await serve(created.create(request, raw_request))

    @app.get("/v1/responses/{response_id}", responses=responses(ResponseObject, 400, 401, 404, stream=True))
    async def retrieve_response(response_id: str, stream: bool = False,
                                starting_after: int | None = Query(default=None, ge=-1)) -> Response:
        return await serve(stored.retrieve(response_id, stream, starting_after))

    @app.post("/v1/responses/{response_id}/cancel", responses=responses(ResponseObject, 400, 401, 404, 413))
    async def cancel_response(response_id: str) -> Response:
        return await serve(_json(stored.cancel(response_id)))

    @app.delete("/v1/responses/{response_id}", responses=responses(DeletedObject, 400, 401, 404))
    async def delete_response(response_id: str) -> Response:
        return await serve(_json(stored.delete(response_id)))

    @app.get("/v1/responses/{response_id}/input_items", responses=responses(ItemList, 400, 401, 404))
    async def list_input_items(response_id: str, limit: int = Query(default=20, ge=1, le=100),
                               order: str = "desc", after: str | None = None) -> Response:
        return await serve(_json(lambda: stored.input_items(response_id, limit=limit, order=order, after=after)))

    @app.post("/v1/responses/{response_id}/tool_outputs", responses=responses(ToolOutputsAccepted, *errors))
    async def submit_tool_outputs(response_id: str, request: ToolOutputsRequest) -> Response:
        return await serve(_json(stored.submit_tool_outputs(response_id, request)))

    @app.post("/v1/conversations", responses=responses(ConversationObject, 400, 401, 413))
    async def create_conversation(request: ConversationCreateRequest) -> Response:
        return await serve(_json(lambda: conversations.create(request)))

    @app.get("/v1/conversations/{conversation_id}", responses=responses(ConversationObject, 400, 401, 404))
    async def retrieve_conversation(conversation_id: str) -> Response:
        return await serve(_json(lambda: conversations.retrieve(conversation_id)))

    @app.post("/v1/conversations/{conversation_id}", responses=responses(ConversationObject, 400, 401, 404, 413))
    async def update_conversation(conversation_id: str, request: ConversationUpdateRequest) -> Response:
        return await serve(_json(lambda: conversations.update(conversation_id, request)))

    @app.delete("/v1/conversations/{conversation_id}", responses=responses(DeletedObject, 400, 401, 404))
    async def delete_conversation(conversation_id: str) -> Response:
        return await serve(_json(lambda: conversations.delete(conversation_id)))

    @app.get("/v1/conversations/{conversation_id}/items", responses=responses(ItemList, 400, 401, 404))
    async def list_conversation_items(conversation_id: str, limit: int = Query(default=20, ge=1, le=100),
                                      order: str = "desc", after: str | None = None) -> Response:
        return await serve(_json(lambda: conversations.list_items(conversation_id, limit=limit, order=order,
                                                                   after=after)))

    @app.post("/v1/conversations/{conversation_id}/items", responses=responses(ItemList, 400, 401, 404, 413))
    async def add_conversation_items(conversation_id: str, request: ConversationItemsRequest) -> Response:
        return await serve(_json(lambda: conversations.add_items(conversation_id, request)))

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}", responses=responses(None, 400, 401, 404))
    async def retrieve_conversation_item(conversation_id: str, item_id: str) -> Response:
        return await serve(_json(lambda: conversations.get_item(conversation_id, item_id)))

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}",
                responses=responses(ConversationObject, 400, 401, 404))
    async def delete_conversation_item(conversation_id: str, item_id: str) -> Response:
        return await serve(_json(lambda: conversations.delete_item(conversation_id, item_id)))
