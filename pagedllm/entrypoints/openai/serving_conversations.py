"""The Conversations API: a conversation is an id, metadata and a list of items in the response
store; a response created with `conversation` reads the items as its history and appends its
input and output to them (serving_responses.py)."""

from __future__ import annotations

import time
from typing import Any

from pagedllm.entrypoints.openai.conversation_limits import ConversationLimitError
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.responses_items import check_metadata, new_id, normalize_input
from pagedllm.entrypoints.openai.responses_protocol import (
    ConversationCreateRequest,
    ConversationItemsRequest,
    ConversationUpdateRequest,
)
from pagedllm.entrypoints.openai.responses_store import ResponseStore
from pagedllm.entrypoints.openai.serving_stored_responses import page


class OpenAIServingConversations:
    def __init__(self, store: ResponseStore | None) -> None:
        self._store = store

    @property
    def store(self) -> ResponseStore:
        if self._store is None:
            raise OpenAIError("this server runs with --disable-responses-store: conversations are not available")
        return self._store

    def _get(self, conversation_id: str) -> dict[str, Any]:
        conv = self.store.get_conversation(conversation_id)
        if conv is None:
            raise OpenAIError(f"Conversation with id '{conversation_id}' not found.", 404, param="conversation_id")
        return conv

    def create(self, request: ConversationCreateRequest) -> dict[str, Any]:
        items = normalize_input(request.items or [], "items")
        conv = {"id": new_id("conv"), "object": "conversation", "created_at": int(time.time()),
                "metadata": check_metadata(request.metadata)}
        self.store.put_conversation(conv)
        if items:
            try:
                self._add(conv["id"], items, "items")
            except OpenAIError:
                self.store.delete_conversation(conv["id"])
                raise
        return conv

    def _add(self, conversation_id: str, items: list[dict[str, Any]], param: str) -> None:
        try:
            self.store.add_conversation_items(conversation_id, items)
        except ConversationLimitError as e:
            raise OpenAIError(str(e), param=param) from None

    def retrieve(self, conversation_id: str) -> dict[str, Any]:
        return self._get(conversation_id)

    def update(self, conversation_id: str, request: ConversationUpdateRequest) -> dict[str, Any]:
        conv = self._get(conversation_id)
        conv["metadata"] = check_metadata(request.metadata)
        self.store.put_conversation(conv)
        return conv

    def delete(self, conversation_id: str) -> dict[str, Any]:
        if not self.store.delete_conversation(conversation_id):
            raise OpenAIError(f"Conversation with id '{conversation_id}' not found.", 404, param="conversation_id")
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    def list_items(self, conversation_id: str, *, limit: int, order: str, after: str | None) -> dict[str, Any]:
        self._get(conversation_id)
        return page(self.store.conversation_items(conversation_id) or [], limit=limit, order=order, after=after)

    def add_items(self, conversation_id: str, request: ConversationItemsRequest) -> dict[str, Any]:
        self._get(conversation_id)
        items = normalize_input(request.items, "items")
        self._add(conversation_id, items, "items")
        return {"object": "list", "data": items, "first_id": items[0]["id"], "last_id": items[-1]["id"],
                "has_more": False}

    def get_item(self, conversation_id: str, item_id: str) -> dict[str, Any]:
        self._get(conversation_id)
        for item in self.store.conversation_items(conversation_id) or []:
            if item.get("id") == item_id:
                return item
        raise OpenAIError(f"Item with id '{item_id}' not found.", 404, param="item_id")

    def delete_item(self, conversation_id: str, item_id: str) -> dict[str, Any]:
        conv = self._get(conversation_id)
        if not self.store.delete_conversation_item(conversation_id, item_id):
            raise OpenAIError(f"Item with id '{item_id}' not found.", 404, param="item_id")
        return conv
