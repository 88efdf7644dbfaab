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
import dataclasses
import functools
import os
import struct
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from pagedllm.transformers_utils.page_cache import read_in_huge_pages

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


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """What the weight loader needs of one tensor, as `gguf.ReaderTensor` names it: `shape` is
    GGUF's (innermost first), `data` a view of the file mapping in gguf-py's layout (typed for
    the float and integer types, rows of bytes for the block types)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


# GGUF metadata value types: fixed sizes, and the two that are not (8 string, 9 array)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


def read_tensor_table(path: str) -> list[GGUFTensorInfo]:
    """The tensors of a GGUF file, without parsing its metadata into fields: the key-value
    section is stepped over (a 262k-token vocabulary's strings are a few hundred thousand length
    reads, not gguf-py's millions of slices), except `general.alignment`. ValueError where the
    file is not a readable little-endian GGUF (then `open_gguf_reader` says more)."""
    import gguf

    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    buf = mm.view(np.ndarray)
    pos = 0

    def take(fmt: str) -> int:
        nonlocal pos
        value = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def skip_string() -> int:  # (`pos += take(...)` would read pos before take moves it)
        nonlocal pos
        n = take("<Q")
        pos += n
        return n

    def text() -> str:
        n = skip_string()
        return bytes(buf[pos - n : pos]).decode("utf-8")

    try:
        if take("<I") != gguf.GGUF_MAGIC or take("<I") not in (2, 3):
            raise ValueError("not a GGUF v2/v3 file in little-endian order")
        n_tensors, n_kv = take("<Q"), take("<Q")
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key, vtype = text(), take("<I")
            if key == "general.alignment" and vtype == 4:
                alignment = take("<I")
            elif vtype == _STRING:
                skip_string()
            elif vtype == _ARRAY:
                etype, count = take("<I"), take("<Q")
                if etype == _STRING:
                    for _ in range(count):
                        skip_string()
                elif etype in _SIZES:
                    pos += _SIZES[etype] * count
                else:
                    raise ValueError(f"metadata {key!r}: arrays of type {etype}")
            elif vtype in _SIZES:
                pos += _SIZES[vtype]
            else:
                raise ValueError(f"metadata {key!r}: value type {vtype}")
        infos = []
        for _ in range(n_tensors):
            name, n_dims = text(), take("<I")
            dims = np.array(struct.unpack_from(f"<{n_dims}Q", buf, pos), dtype=np.uint64)
            pos += 8 * n_dims
            infos.append((name, dims, gguf.GGMLQuantizationType(take("<I")), take("<Q")))
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    start = -(-pos // alignment) * alignment
    out = []
    for name, dims, qtype, offset in infos:
        np_dims = tuple(int(d) for d in reversed(dims.tolist()))
        count = int(np.prod(np_dims))
        typed = _TYPED.get(qtype.name)
        if typed is not None:
            data = mm[start + offset : start + offset + count * np.dtype(typed).itemsize].view(typed).reshape(np_dims)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = count // block * size
            data = mm[start + offset : start + offset + nbytes].reshape(gguf.quant_shape_to_byte_shape(np_dims, qtype))
        out.append(GGUFTensorInfo(name, qtype, dims, data))
    read_in_huge_pages(mm, path, start)
    return out
