"""A conversation is bounded in items and in bytes per item (--max-conversation-items,
--max-conversation-item-bytes): adding past either is a 400 naming the flag, on every path
that adds items (create, add items, a response with `conversation`), with either store."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.conversation_limits import ConversationLimitError, ConversationLimits
from pagedllm.entrypoints.openai.responses_store import make_response_store
from pagedllm.entrypoints.openai.server_config import DEFAULT_MAX_CONVERSATION_ITEMS, ServerConfig
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE


def _client(engine, tmp_path, store: str, **config) -> TestClient:
    url = None if store == "memory" else f"sqlite:///{tmp_path / 'r.db'}"
    return TestClient(build_app(engine, ServerConfig(chat_template=CHAT_TEMPLATE, responses_store=url, **config)))


def _items(n: int, size: int = 1) -> list[dict]:
    return [{"role": "user", "content": "x" * size}] * n


def _error(r, needle: str) -> None:
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_items_and_item_bytes_are_bounded(fake_engine, tmp_path, store):
    with _client(fake_engine, tmp_path, store, max_conversation_items=5, max_conversation_item_bytes=2000) as c:
        _error(c.post("/v1/conversations", json={"items": _items(1, 5000)}), "--max-conversation-item-bytes (2000)")
        _error(c.post("/v1/conversations", json={"items": _items(6)}), "--max-conversation-items (5)")
        conv = c.post("/v1/conversations", json={"items": _items(3)}).json()
        url = f"/v1/conversations/{conv['id']}/items"
        _error(c.post(url, json={"items": _items(1, 5000)}), "--max-conversation-item-bytes")
        _error(c.post(url, json={"items": _items(3)}), "--max-conversation-items (5)")
        assert c.post(url, json={"items": _items(1)}).status_code == 200
        # a response needs room for its input and an output
        body = {"model": "fake-model", "input": "hi", "conversation": conv["id"], "max_output_tokens": 2}
        _error(c.post("/v1/responses", json=body), "--max-conversation-items (5)")
        assert len(c.get(url).json()["data"]) == 4  # nothing partly added
        c.delete(f"{url}/{c.get(url).json()['data'][0]['id']}")
        r = c.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        assert len(c.get(url).json()["data"]) == 5
        _error(c.post("/v1/responses", json={**body, "input": "y" * 5000}), "--max-conversation-item-bytes")


def test_items_are_bounded_at_the_default(fake_engine, tmp_path):
    with _client(fake_engine, tmp_path, "memory") as c:
        conv = c.post("/v1/conversations", json={}).json()
        url = f"/v1/conversations/{conv['id']}/items"
        for _ in range(DEFAULT_MAX_CONVERSATION_ITEMS // 20):
            assert c.post(url, json={"items": _items(20)}).status_code == 200
        _error(c.post(url, json={"items": _items(1)}), f"--max-conversation-items ({DEFAULT_MAX_CONVERSATION_ITEMS})")
        _error(c.post(url, json={"items": [{"role": "user", "content": "x" * (1 << 20)}]}),
               "--max-conversation-item-bytes (1048576)")


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_the_store_enforces_the_limits(tmp_path, store):
    url = None if store == "memory" else f"sqlite:///{tmp_path / 'r.db'}"
    s = make_response_store(url, conversation_limits=ConversationLimits(max_items=2, max_item_bytes=100))
    s.put_conversation({"id": "c", "object": "conversation"})
    s.add_conversation_items("c", [{"id": "a"}, {"id": "b"}])
    with pytest.raises(ConversationLimitError):
        s.add_conversation_items("c", [{"id": "d"}])
    s.delete_conversation_item("c", "a")
    with pytest.raises(ConversationLimitError):
        s.add_conversation_items("c", [{"id": "e", "text": "é" * 50}])  # 100 characters, over 100 bytes
    s.add_conversation_items("c", [{"id": "e"}])
    assert [i["id"] for i in s.conversation_items("c")] == ["b", "e"]
    with pytest.raises(ValueError):
        ConversationLimits(max_items=0)
