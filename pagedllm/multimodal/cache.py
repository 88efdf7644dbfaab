"""Processed images by content hash, least recently used first out, bounded in bytes.

The front end keeps one to skip the image processor for an image it has seen. The same class
mirrors what crosses to the engine core: the client's copy (`MirroredSender`) and the core's
(`MirroredReceiver`) see the same identifiers in the same order with the same sizes, so they
evict alike, and the client sends an image's arrays only when the core's copy lacks them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from pagedllm.protocol import MultiModalFeature

DEFAULT_CACHE_BYTES = 512 << 20


def nbytes_of(data: dict[str, Any]) -> int:
    return sum(len(v.data) if hasattr(v, "data") and isinstance(v.data, bytes) else getattr(v, "nbytes", 0)
               for v in data.values())


class LRUBytesCache:
    """identifier → value, at most `capacity` bytes of values (one larger value is not kept)."""

    def __init__(self, capacity: int = DEFAULT_CACHE_BYTES) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.size = 0
        self.hits = self.queries = 0
        self._lock = threading.Lock()  # the front end processes requests on several threads

    def get(self, key: str) -> Any | None:
        with self._lock:
            self.queries += 1
            entry = self.entries.get(key)
            if entry is None:
                return None
            self.hits += 1
            self.entries.move_to_end(key)
            return entry[0]

    def put(self, key: str, value: Any, nbytes: int) -> None:
        with self._lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.size -= old[1]
            if nbytes > self.capacity:
                return
            self.entries[key] = (value, nbytes)
            self.size += nbytes
            while self.size > self.capacity:
                _, (_, n) = self.entries.popitem(last=False)
                self.size -= n

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)


class MirroredSender:
    """The client's view of the core's cache: strips the arrays of images the core holds."""

    def __init__(self, capacity: int = DEFAULT_CACHE_BYTES) -> None:
        self.cache = LRUBytesCache(capacity)

    def strip(self, features: list[MultiModalFeature]) -> list[MultiModalFeature]:
        out = []
        for f in features:
            if self.cache.get(f.identifier) is not None:  # the core has them: it touches its copy alike
                out.append(MultiModalFeature(f.modality, f.identifier, f.offset, f.length, None))
                continue
            self.cache.put(f.identifier, True, nbytes_of(f.data))
            out.append(f)
        return out


class MirroredReceiver:
    """The core's copy: fills in the arrays the client left out, and keeps the ones it sent."""

    def __init__(self, capacity: int = DEFAULT_CACHE_BYTES) -> None:
        self.cache = LRUBytesCache(capacity)

    def fill(self, features: list[MultiModalFeature]) -> list[MultiModalFeature]:
        out = []
        for f in features:
            if f.data is None:
                data = self.cache.get(f.identifier)
                if data is None:  # the two copies disagree: a bug, never silently wrong pixels
                    raise RuntimeError(f"image {f.identifier[:12]} was sent as cached, and the core has no copy")
                out.append(MultiModalFeature(f.modality, f.identifier, f.offset, f.length, data))
                continue
            self.cache.put(f.identifier, f.data, nbytes_of(f.data))
            out.append(f)
        return out
