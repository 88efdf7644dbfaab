"""One fast parse of a GGUF file's metadata, shared by every reader of it during a conversion.

`gguf.GGUFReader` slices its `np.memmap` once per value: a 262k-token vocabulary is ~10 million
slices, and each pays for memmap's `__array_finalize__`. On a 2-core EPYC that is ~19 s per parse
of Gemma 3's GGUF, and a conversion parses it three times (pagedllm, then transformers' config
and tokenizer helpers, which open the file by path). Slicing a plain-ndarray view of the same
mapping gives identical fields in ~4 s, and `shared_gguf_reader` hands that one reader to
transformers' helpers too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

_lock = threading.Lock()
_shared: dict[str, list[Any]] = {}  # real path -> readers, innermost `shared_gguf_reader` last
_stock: Any = None  # gguf.GGUFReader while the dispatcher stands in for it


@functools.cache
def _reader_class() -> type:
    from gguf.gguf_reader import GGUFReader  # the class itself, never the dispatcher

    class FastGGUFReader(GGUFReader):
        """`GGUFReader` whose metadata reads slice an ndarray view, not the memmap itself."""

        def _get(self, offset: int, dtype: Any, count: int = 1,
                 override_order: str | None = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:  # first call comes from GGUFReader.__init__, right after self.data
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            dt = np.dtype(dtype)
            arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    return FastGGUFReader


def open_gguf_reader(path: str) -> Any:
    """Parse `path`'s header and metadata; ValueError if it is not a readable GGUF file."""
    try:
        return _reader_class()(path)
    except Exception as exc:  # bad magic, truncated or empty file, unsupported version
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def _dispatch(path: Any, *args: Any, **kwargs: Any) -> Any:
    """What `gguf.GGUFReader(...)` calls while a reader is shared."""
    if not args and not kwargs:
        with _lock:
            readers = _shared.get(os.path.realpath(os.fspath(path)))
            if readers:
                return readers[-1]
    from gguf.gguf_reader import GGUFReader

    return GGUFReader(path, *args, **kwargs)


@contextlib.contextmanager
def shared_gguf_reader(reader: Any, *paths: str) -> Iterator[None]:
    """While active, `gguf.GGUFReader(p)` for any of `paths` (or a link to the same file) returns
    `reader` instead of parsing again; other files parse as usual. Nests (the innermost reader
    of a path wins) and is safe across threads."""
    import gguf

    global _stock
    keys = [os.path.realpath(p) for p in paths]
    with _lock:
        if not _shared:
            _stock, gguf.GGUFReader = gguf.GGUFReader, _dispatch
        for key in keys:
            _shared.setdefault(key, []).append(reader)
    try:
        yield
    finally:
        with _lock:
            for key in keys:
                readers = _shared[key]
                del readers[max(i for i, r in enumerate(readers) if r is reader)]  # this block's own entry
                if not readers:
                    del _shared[key]
            if not _shared:
                gguf.GGUFReader, _stock = _stock, None


class _ConfigFields:
    """A reader that shows its metadata minus the vocabulary's per-token arrays (scores, token
    types, merges): transformers' config helper parses every field's every value, ~0.8 million
    for a 262k vocabulary, to use none of these. The token list stays where the file gives no
    vocab_size, since transformers counts it instead."""

    def __init__(self, reader: Any, arch: str) -> None:
        keep_tokens = f"{arch}.vocab_size" not in reader.fields
        self._reader = reader
        self.fields = type(reader.fields)(
            (key, field) for key, field in reader.fields.items()
            if len(field.data) <= 1024 or (keep_tokens and key == "tokenizer.ggml.tokens"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


def config_view(reader: Any, arch: str) -> Any:
    """`reader` for building a model config: the same, without the large per-token arrays."""
    return _ConfigFields(reader, arch)
