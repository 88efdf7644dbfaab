"""Storage behind the Responses API (`store=true`, `previous_response_id`, `GET /v1/responses/{id}`, input items)
and the Conversations API.

A plain-data layer: everything in and out is JSON-serialisable dicts/lists, and everything handed out is a copy, so
the server may mutate what it gets without changing what is stored. Two backends: in memory (the default, lost on
restart) and SQLite (one file, survives a restart). Both are bounded by count and optionally by age, because a server
that stores responses by default would otherwise grow without limit.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.conversation_limits import ConversationLimits

Clock = Callable[[], float]


@dataclass(slots=True)
class StoredResponse:
    """One stored response: enough to show it, list its input, continue from it and replay its stream."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]
    events: list[dict[str, Any]]
    request: dict[str, Any] = field(default_factory=dict)  # the request body, to resume after tool outputs
    created_at: float = field(default_factory=time.time)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class ResponseStore(ABC):
    """Bounded: at most `max_entries` responses (the least recently written is evicted first) and conversations
    (same bound, counted separately), each expiring `ttl` seconds after its last write (ttl None: never).

    Adding or deleting a conversation's items counts as a write of the conversation, so a conversation in use
    neither expires nor is evicted. `clock` (wall time, so SQLite ages survive a restart) is injectable for tests."""

    conversation_limits = ConversationLimits()  # items per conversation, bytes per item

    def __init__(self, max_entries: int = 1000, ttl: float | None = None, *, clock: Clock = time.time):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds (or None for no expiry), got {ttl}")
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock

    def _expired(self, written_at: float, now: float) -> bool:
        return self.ttl is not None and written_at + self.ttl <= now

    @abstractmethod
    def put(self, record: StoredResponse) -> None: ...
    @abstractmethod
    def get(self, response_id: str) -> StoredResponse | None: ...
    @abstractmethod
    def delete(self, response_id: str) -> bool: ...
    @abstractmethod
    def __len__(self) -> int: ...
    @abstractmethod
    def put_conversation(self, conversation: dict[str, Any]) -> None: ...
    @abstractmethod
    def get_conversation(self, conversation_id: str) -> dict[str, Any] | None: ...
    @abstractmethod
    def delete_conversation(self, conversation_id: str) -> bool: ...
    @abstractmethod
    def add_conversation_items(self, conversation_id: str, items: list[dict[str, Any]]) -> None: ...
    @abstractmethod
    def conversation_items(self, conversation_id: str) -> list[dict[str, Any]] | None: ...
    @abstractmethod
    def delete_conversation_item(self, conversation_id: str, item_id: str) -> bool: ...
    @abstractmethod
    def close(self) -> None: ...


class InMemoryResponseStore(ResponseStore):
    """Ordered dicts under one lock. Values are kept as JSON text, which makes every put and get a copy."""

    def __init__(self, max_entries: int = 1000, ttl: float | None = None, *, clock: Clock = time.time):
        super().__init__(max_entries, ttl, clock=clock)
        self._lock = threading.Lock()
        # id -> (written_at, JSON), oldest write first: the front is what expires or is evicted next.
        self._responses: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._conversations: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._items: dict[str, list[tuple[str | None, str]]] = {}  # conversation id -> [(item id, JSON)]

    @contextmanager
    def _writing(self) -> Iterator[float]:
        """Purge before the write (so a re-put of an expired entry starts afresh) and trim to the bound after."""
        with self._lock:
            now = self._clock()
            self._prune(now)
            yield now
            self._prune(now)

    def _prune(self, now: float) -> None:
        for entries in (self._responses, self._conversations):
            while entries:
                key, (written_at, _) = next(iter(entries.items()))
                if not (self._expired(written_at, now) or len(entries) > self.max_entries):
                    break
                del entries[key]
                if entries is self._conversations:
                    self._items.pop(key, None)

    def _live(self, entries: OrderedDict[str, tuple[float, str]], key: str) -> str | None:
        entry = entries.get(key)
        return None if entry is None or self._expired(entry[0], self._clock()) else entry[1]

    @staticmethod
    def _touch(entries: OrderedDict[str, tuple[float, str]], key: str, now: float, text: str) -> None:
        entries.pop(key, None)
        entries[key] = (now, text)

    def put(self, record: StoredResponse) -> None:
        text = _dumps(asdict(record))
        with self._writing() as now:
            self._touch(self._responses, record.response["id"], now, text)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            text = self._live(self._responses, response_id)
        return None if text is None else StoredResponse(**json.loads(text))

    def delete(self, response_id: str) -> bool:
        with self._writing():
            return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            now = self._clock()
            return sum(not self._expired(written_at, now) for written_at, _ in self._responses.values())

    def put_conversation(self, conversation: dict[str, Any]) -> None:
        text = _dumps(conversation)
        with self._writing() as now:
            self._touch(self._conversations, conversation["id"], now, text)
            self._items.setdefault(conversation["id"], [])

    def get_conversation(self, conversation_id: str) -> dict[str, Any] | None:
        with self._lock:
            text = self._live(self._conversations, conversation_id)
        return None if text is None else json.loads(text)

    def delete_conversation(self, conversation_id: str) -> bool:
        with self._writing():
            self._items.pop(conversation_id, None)
            return self._conversations.pop(conversation_id, None) is not None

    def add_conversation_items(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        texts = [(item.get("id"), _dumps(item)) for item in items]
        with self._writing() as now:
            if conversation_id not in self._conversations:
                raise KeyError(conversation_id)
            self.conversation_limits.check(len(self._items[conversation_id]), [text for _, text in texts])
            self._items[conversation_id].extend(texts)
            self._touch(self._conversations, conversation_id, now, self._conversations[conversation_id][1])

    def conversation_items(self, conversation_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            if self._live(self._conversations, conversation_id) is None:
                return None
            texts = [text for _, text in self._items[conversation_id]]
        return [json.loads(text) for text in texts]

    def delete_conversation_item(self, conversation_id: str, item_id: str) -> bool:
        with self._writing() as now:
            items = self._items.get(conversation_id)
            if items is None:
                return False
            kept = [entry for entry in items if entry[0] != item_id]
            if len(kept) == len(items):
                return False
            self._items[conversation_id] = kept
            self._touch(self._conversations, conversation_id, now, self._conversations[conversation_id][1])
            return True

    def close(self) -> None:
        with self._lock:
            self._responses.clear()
            self._conversations.clear()
            self._items.clear()


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, written_at REAL NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS conversations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, written_at REAL NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS conversation_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id TEXT NOT NULL, item_id TEXT, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS conversation_items_by_conversation ON conversation_items (conversation_id, seq);
"""
# `seq` orders rows by write: INSERT OR REPLACE deletes the old row and gives the new one a higher seq.
_EXPIRED = "written_at + ? <= ?"
_OVER_BOUND = "seq NOT IN (SELECT seq FROM {table} ORDER BY seq DESC LIMIT ?)"
_TOUCH_CONVERSATION = (
    "INSERT OR REPLACE INTO conversations (id, written_at, data) SELECT id, ?, data FROM conversations WHERE id = ?"
)


class SQLiteResponseStore(ResponseStore):
    """One SQLite file (WAL mode) shared by the server's threads under a lock; ages are wall time, so a restart
    keeps both the data and how old it is."""

    def __init__(self, path: str, max_entries: int = 1000, ttl: float | None = None, *, clock: Clock = time.time):
        super().__init__(max_entries, ttl, clock=clock)
        directory = os.path.dirname(os.path.abspath(path))
        if path != ":memory:" and not os.path.isdir(directory):
            raise ValueError(f"response store database {path!r}: directory {directory!r} does not exist")
        self.path = path
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(_SCHEMA)

    @contextmanager
    def _writing(self) -> Iterator[float]:
        """One transaction: purge, write, trim to the bound (see InMemoryResponseStore._writing)."""
        with self._lock, self._conn:
            now = self._clock()
            self._purge(now)
            yield now
            self._purge(now)

    def _purge(self, now: float) -> None:
        """Drop expired rows, then the oldest past max_entries; conversations take their items with them."""
        run = self._conn.execute
        conditions: list[tuple[str, tuple[Any, ...]]] = [] if self.ttl is None else [(_EXPIRED, (self.ttl, now))]
        conditions.append((_OVER_BOUND, (self.max_entries,)))
        for where, args in conditions:
            run(f"DELETE FROM responses WHERE {where.format(table='responses')}", args)
            where = where.format(table="conversations")
            run(
                f"DELETE FROM conversation_items WHERE conversation_id IN (SELECT id FROM conversations WHERE {where})",
                args,
            )
            run(f"DELETE FROM conversations WHERE {where}", args)

    def _live(self, table: str, key: str) -> str | None:
        row = self._conn.execute(f"SELECT written_at, data FROM {table} WHERE id = ?", (key,)).fetchone()
        return None if row is None or self._expired(row[0], self._clock()) else row[1]

    def put(self, record: StoredResponse) -> None:
        text = _dumps(asdict(record))
        with self._writing() as now:
            self._conn.execute(
                "INSERT OR REPLACE INTO responses (id, written_at, data) VALUES (?, ?, ?)",
                (record.response["id"], now, text),
            )

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            text = self._live("responses", response_id)
        return None if text is None else StoredResponse(**json.loads(text))

    def delete(self, response_id: str) -> bool:
        with self._writing():
            return self._conn.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            now = self._clock()
            return self._conn.execute(
                "SELECT COUNT(*) FROM responses WHERE ? IS NULL OR written_at + ? > ?", (self.ttl, self.ttl, now)
            ).fetchone()[0]

    def put_conversation(self, conversation: dict[str, Any]) -> None:
        text = _dumps(conversation)
        with self._writing() as now:
            self._conn.execute(
                "INSERT OR REPLACE INTO conversations (id, written_at, data) VALUES (?, ?, ?)",
                (conversation["id"], now, text),
            )

    def get_conversation(self, conversation_id: str) -> dict[str, Any] | None:
        with self._lock:
            text = self._live("conversations", conversation_id)
        return None if text is None else json.loads(text)

    def delete_conversation(self, conversation_id: str) -> bool:
        with self._writing():
            self._conn.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (conversation_id,))
            return self._conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,)).rowcount > 0

    def add_conversation_items(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        rows = [(conversation_id, item.get("id"), _dumps(item)) for item in items]
        with self._writing() as now:
            if self._conn.execute(_TOUCH_CONVERSATION, (now, conversation_id)).rowcount == 0:
                raise KeyError(conversation_id)
            (have,) = self._conn.execute(
                "SELECT COUNT(*) FROM conversation_items WHERE conversation_id = ?", (conversation_id,)
            ).fetchone()
            self.conversation_limits.check(have, [row[2] for row in rows])
            self._conn.executemany(
                "INSERT INTO conversation_items (conversation_id, item_id, data) VALUES (?, ?, ?)", rows
            )

    def conversation_items(self, conversation_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            if self._live("conversations", conversation_id) is None:
                return None
            rows = self._conn.execute(
                "SELECT data FROM conversation_items WHERE conversation_id = ? ORDER BY seq", (conversation_id,)
            ).fetchall()
        return [json.loads(text) for (text,) in rows]

    def delete_conversation_item(self, conversation_id: str, item_id: str) -> bool:
        with self._writing() as now:
            deleted = (
                self._conn.execute(
                    "DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                    (conversation_id, item_id),
                ).rowcount
                > 0
            )
            if deleted:
                self._conn.execute(_TOUCH_CONVERSATION, (now, conversation_id))
            return deleted

    def close(self) -> None:
        with self._lock:
            self._conn.close()


_SQLITE_PREFIX = "sqlite:///"


def make_response_store(
    url: str | None, max_entries: int = 1000, ttl: float | None = None, *, clock: Clock = time.time,
    conversation_limits: ConversationLimits | None = None,
) -> ResponseStore:
    """None or "memory" -> InMemoryResponseStore; "sqlite:///relative.db" or "sqlite:////abs/path.db" (the
    SQLAlchemy convention: the path is whatever follows the third slash) -> SQLiteResponseStore. A missing
    directory and any other form are a ValueError."""
    store: ResponseStore
    if url is None or url == "memory":
        store = InMemoryResponseStore(max_entries, ttl, clock=clock)
    elif url.startswith(_SQLITE_PREFIX) and len(url) > len(_SQLITE_PREFIX):
        store = SQLiteResponseStore(url[len(_SQLITE_PREFIX) :], max_entries, ttl, clock=clock)
    else:
        raise ValueError(f"unsupported response store {url!r}: use 'memory', 'sqlite:///relative/path.db' or "
                         "'sqlite:////abs/path.db'")
    if conversation_limits is not None:
        store.conversation_limits = conversation_limits
    return store
