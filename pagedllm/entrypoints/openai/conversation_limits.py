"""Bounds on one conversation: without them, repeated POSTs of large items grow the response
store (memory or SQLite) without limit."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai.server_config import (
    DEFAULT_MAX_CONVERSATION_ITEM_BYTES,
    DEFAULT_MAX_CONVERSATION_ITEMS,
)


class ConversationLimitError(ValueError):
    """Adding these items would take a conversation past its limits: the request's fault (400)."""


@dataclass(frozen=True)
class ConversationLimits:
    max_items: int = DEFAULT_MAX_CONVERSATION_ITEMS
    max_item_bytes: int = DEFAULT_MAX_CONVERSATION_ITEM_BYTES

    def __post_init__(self) -> None:
        if self.max_items < 1 or self.max_item_bytes < 1:
            raise ValueError(f"conversation limits must be >= 1, got {self.max_items} items, "
                             f"{self.max_item_bytes} bytes per item")

    def check(self, have: int, texts: list[str]) -> None:
        """`texts`: the new items' JSON. Raised before anything is stored."""
        for text in texts:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > self.max_item_bytes:
                raise ConversationLimitError(
                    f"a conversation item of {size} bytes is larger than --max-conversation-item-bytes "
                    f"({self.max_item_bytes})")
        if have + len(texts) > self.max_items:
            raise ConversationLimitError(
                f"the conversation has {have} items; {len(texts)} more would exceed --max-conversation-items "
                f"({self.max_items})")
