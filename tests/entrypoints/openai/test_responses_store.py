"""The Responses/Conversations store, both backends: copies, bounds, TTL (injected clock), items, SQLite restart."""

from __future__ import annotations

import threading

import pytest

from pagedllm.entrypoints.openai.responses_store import (
    InMemoryResponseStore,
    ResponseStore,
    SQLiteResponseStore,
    StoredResponse,
    make_response_store,
)


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request, tmp_path):
    stores: list[ResponseStore] = []

    def make(**kwargs) -> ResponseStore:
        if request.param == "memory":
            store: ResponseStore = InMemoryResponseStore(**kwargs)
        else:
            store = SQLiteResponseStore(str(tmp_path / "responses.db"), **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def record(rid: str, text: str = "hi") -> StoredResponse:
    return StoredResponse(
        response={"id": rid, "status": "completed", "output": [{"type": "message", "text": text}]},
        input_items=[{"id": f"in_{rid}", "type": "message", "role": "user", "content": "héllo ✓"}],
        history=[{"role": "user", "content": "héllo ✓"}, {"role": "assistant", "content": text}],
        events=[{"type": "response.created", "sequence_number": 0}, {"type": "response.done", "sequence_number": 1}],
        created_at=123.5,
    )


def conversation(cid: str, **metadata) -> dict:
    return {"id": cid, "object": "conversation", "created_at": 100, "metadata": metadata}


def item(iid: str) -> dict:
    return {"id": iid, "type": "message", "role": "user", "content": [{"type": "input_text", "text": iid}]}


def test_round_trip(make_store):
    store = make_store()
    assert store.get("resp_1") is None and len(store) == 0
    store.put(record("resp_1"))
    assert store.get("resp_1") == record("resp_1")
    assert len(store) == 1
    store.put(record("resp_1", text="replaced"))
    assert store.get("resp_1").response["output"][0]["text"] == "replaced"
    assert len(store) == 1


def test_values_are_copies(make_store):
    store = make_store()
    rec = record("resp_1")
    store.put(rec)
    rec.response["status"] = "mutated"
    rec.history.append({"role": "user", "content": "x"})
    got = store.get("resp_1")
    assert got == record("resp_1")
    got.events.clear()
    got.input_items[0]["content"] = "changed"
    assert store.get("resp_1") == record("resp_1")

    conv = conversation("conv_1", a="1")
    store.put_conversation(conv)
    conv["metadata"]["a"] = "2"
    store.get_conversation("conv_1")["metadata"]["a"] = "3"
    assert store.get_conversation("conv_1") == conversation("conv_1", a="1")
    items = [item("msg_1")]
    store.add_conversation_items("conv_1", items)
    items[0]["content"] = []
    store.conversation_items("conv_1")[0]["role"] = "assistant"
    assert store.conversation_items("conv_1") == [item("msg_1")]


def test_delete(make_store):
    store = make_store()
    store.put(record("resp_1"))
    store.put(record("resp_2"))
    assert store.delete("resp_1") is True
    assert store.delete("resp_1") is False
    assert store.get("resp_1") is None and store.get("resp_2") is not None
    assert len(store) == 1


def test_eviction_least_recently_written(make_store):
    store = make_store(max_entries=3)
    for rid in ("a", "b", "c"):
        store.put(record(rid))
    store.put(record("a", text="rewritten"))  # a is now the most recently written; b is the oldest
    store.get("b")  # reading does not count
    store.put(record("d"))
    assert store.get("b") is None
    assert [rid for rid in "acd" if store.get(rid) is not None] == ["a", "c", "d"]
    assert len(store) == 3
    store.put(record("e"))
    assert store.get("c") is None and len(store) == 3


def test_conversation_eviction_counted_separately(make_store):
    store = make_store(max_entries=2)
    store.put(record("resp_1"))
    store.put(record("resp_2"))
    store.put_conversation(conversation("c1"))
    store.put_conversation(conversation("c2"))
    store.add_conversation_items("c1", [item("m1")])  # adding items is a write: c2 is now the oldest
    store.put_conversation(conversation("c3"))
    assert store.get_conversation("c2") is None and store.conversation_items("c2") is None
    assert store.get_conversation("c1") is not None and store.get_conversation("c3") is not None
    assert store.conversation_items("c1") == [item("m1")]
    assert len(store) == 2  # responses untouched
    store.put_conversation(conversation("c4"))  # evicts c1 (written before c3)
    assert store.get_conversation("c1") is None
    store.put_conversation(conversation("c1"))  # evicts c3; a re-put of an evicted conversation has no items
    assert store.get_conversation("c3") is None and store.get_conversation("c4") is not None
    assert store.conversation_items("c1") == []


def test_ttl_responses(make_store):
    clock = FakeClock()
    store = make_store(ttl=10, clock=clock)
    store.put(record("old"))
    clock.now += 6
    store.put(record("new"))
    clock.now += 4  # old is exactly 10 s old: expired
    assert store.get("old") is None and store.get("new") is not None
    assert len(store) == 1
    assert store.delete("old") is False
    clock.now += 6
    assert store.get("new") is None and len(store) == 0
    store.put(record("new"))  # a rewrite restarts the clock
    clock.now += 9
    assert store.get("new") is not None


def test_ttl_conversations(make_store):
    clock = FakeClock()
    store = make_store(ttl=10, clock=clock)
    store.put_conversation(conversation("c1"))
    store.add_conversation_items("c1", [item("m1")])
    clock.now += 8
    store.add_conversation_items("c1", [item("m2")])  # a write: restarts c1's clock
    clock.now += 8
    assert store.conversation_items("c1") == [item("m1"), item("m2")]
    clock.now += 2
    assert store.get_conversation("c1") is None and store.conversation_items("c1") is None
    with pytest.raises(KeyError):
        store.add_conversation_items("c1", [item("m3")])
    assert store.delete_conversation_item("c1", "m1") is False
    assert store.delete_conversation("c1") is False
    store.put_conversation(conversation("c1"))  # an expired conversation's items are gone with it
    assert store.conversation_items("c1") == []


def test_conversation_items(make_store):
    store = make_store()
    assert store.get_conversation("c1") is None and store.conversation_items("c1") is None
    store.put_conversation(conversation("c1"))
    store.put_conversation(conversation("c2"))
    assert store.conversation_items("c1") == []
    store.add_conversation_items("c1", [item("m1"), item("m2")])
    store.add_conversation_items("c2", [item("x1")])
    store.add_conversation_items("c1", [item("m3")])
    store.add_conversation_items("c1", [])
    assert store.conversation_items("c1") == [item("m1"), item("m2"), item("m3")]

    store.put_conversation(conversation("c1", topic="updated"))  # replacing keeps the items
    assert store.get_conversation("c1")["metadata"] == {"topic": "updated"}
    assert [i["id"] for i in store.conversation_items("c1")] == ["m1", "m2", "m3"]

    assert store.delete_conversation_item("c1", "m2") is True
    assert store.delete_conversation_item("c1", "m2") is False
    assert store.delete_conversation_item("c1", "x1") is False  # another conversation's item
    assert store.delete_conversation_item("nope", "m1") is False
    assert [i["id"] for i in store.conversation_items("c1")] == ["m1", "m3"]

    assert store.delete_conversation("c1") is True
    assert store.delete_conversation("c1") is False
    assert store.get_conversation("c1") is None and store.conversation_items("c1") is None
    store.put_conversation(conversation("c1"))  # the items went with the conversation
    assert store.conversation_items("c1") == []
    assert store.conversation_items("c2") == [item("x1")]


def test_items_of_missing_conversation(make_store):
    store = make_store()
    with pytest.raises(KeyError):
        store.add_conversation_items("missing", [item("m1")])
    store.put_conversation(conversation("c1"))
    assert store.conversation_items("missing") is None


def test_concurrent_writes(make_store):
    store = make_store(max_entries=50)

    def work(n: int) -> None:
        for i in range(20):
            store.put(record(f"r{n}_{i}"))
            store.get(f"r{n}_{i}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store) == 50


@pytest.mark.parametrize("kwargs", [{"max_entries": 0}, {"ttl": 0}, {"ttl": -1.0}])
def test_invalid_bounds(make_store, kwargs):
    with pytest.raises(ValueError):
        make_store(**kwargs)


def test_sqlite_survives_restart(tmp_path):
    path = str(tmp_path / "store.db")
    clock = FakeClock()
    store = SQLiteResponseStore(path, ttl=100, clock=clock)
    store.put(record("resp_1"))
    store.put_conversation(conversation("c1", k="v"))
    store.add_conversation_items("c1", [item("m1"), item("m2")])
    store.close()

    clock.now += 50
    reopened = SQLiteResponseStore(path, ttl=100, clock=clock)
    try:
        assert reopened.get("resp_1") == record("resp_1")
        assert reopened.get_conversation("c1") == conversation("c1", k="v")
        assert reopened.conversation_items("c1") == [item("m1"), item("m2")]
        assert len(reopened) == 1
        clock.now += 50  # ages are wall time, so they carried over the restart
        assert reopened.get("resp_1") is None and reopened.get_conversation("c1") is None
    finally:
        reopened.close()


def test_make_response_store(tmp_path, monkeypatch):
    for url in (None, "memory"):
        store = make_response_store(url, max_entries=5, ttl=2.0)
        assert isinstance(store, InMemoryResponseStore) and store.max_entries == 5 and store.ttl == 2.0
        store.close()

    absolute = tmp_path / "abs" / "store.db"
    absolute.parent.mkdir()
    store = make_response_store(f"sqlite:///{absolute}")  # absolute path: four slashes
    assert isinstance(store, SQLiteResponseStore) and store.path == str(absolute)
    store.put(record("resp_1"))
    store.close()
    assert absolute.exists()

    monkeypatch.chdir(tmp_path)
    store = make_response_store("sqlite:///relative.db", max_entries=3)
    assert isinstance(store, SQLiteResponseStore) and store.path == "relative.db" and store.max_entries == 3
    store.close()
    assert (tmp_path / "relative.db").exists()

    with pytest.raises(ValueError, match="does not exist"):
        make_response_store(f"sqlite:///{tmp_path}/missing/store.db")
    assert not (tmp_path / "missing").exists()
    for bad in ("", "redis://localhost", "sqlite://rel.db", "sqlite:///", "Memory", "/tmp/x.db"):
        with pytest.raises(ValueError, match="'memory'"):
            make_response_store(bad)
    with pytest.raises(ValueError):
        make_response_store("memory", max_entries=0)
