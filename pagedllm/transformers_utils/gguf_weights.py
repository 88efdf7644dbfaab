"""A GGUF file's tensors under their Hugging Face names, read straight from the memory-mapped
file one at a time: nothing is converted to a float32 checkpoint.

Each tensor comes as a `GGUFTensor`, a `CheckpointTensor` whose float view (`load()`, slices)
is dequantized on demand with llama.cpp's fix-ups undone (`gguf_archs.fix_up`). When the engine
runs the file's own blocks (`--quantization gguf`), the tensors are `native`: the layers that can
multiply by quantized blocks (linears, the embedding and the LM head) keep `block_rows()`, views
of the file's rows, and never build a float copy; the other parameters (norms, biases) take the
float view. Row-permuting fix-ups (llama's q/k) are applied to whole rows of blocks, which
quantization keeps independent.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.transformers_utils.checkpoint_tensor import CheckpointTensor
from pagedllm.transformers_utils.gguf_archs import (
    EXPERTS,
    IGNORED_TENSORS,
    fix_up,
    hf_names,
    row_order,
    split_experts,
    transposed_in_file,
)

logger = logging.getLogger(__name__)

SOURCE_FILE = "gguf_source.json"
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# Block types the engine multiplies natively (pagedllm/csrc/gguf.c), besides the float ones:
# what llama.cpp's Q4_0, Q4_K_M, Q5_K_M, Q6_K and Q8_0 files hold.
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def gguf_source(model_dir: str) -> dict[str, Any] | None:
    """What a converted GGUF directory records of its source file; None for other directories."""
    meta = Path(model_dir) / SOURCE_FILE
    return json.loads(meta.read_text()) if meta.is_file() else None


def check_tensor_types(tensors: Iterable[Any], path: str) -> None:
    """A clear error at start for tensors of a type the engine cannot read, naming them."""
    supported = (*FLOAT_TYPES, *NATIVE_TYPES)
    bad: dict[str, list[str]] = {}
    for t in tensors:
        if t.tensor_type.name not in supported and t.name not in IGNORED_TENSORS:
            bad.setdefault(t.tensor_type.name, []).append(t.name)
    if bad:
        listed = "; ".join(f"{kind}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} ({len(names)} tensors)"
                           for kind, names in sorted(bad.items()))
        raise ValueError(f"{path} holds GGUF tensor types pagedllm does not support ({listed}); supported: "
                         f"{', '.join(supported)}. Requantize it with llama-quantize (e.g. Q4_K_M).")


class GGUFTensor(CheckpointTensor):
    """One GGUF tensor as its HF parameter: `shape` is the HF shape, `load()` the float32 values
    (fix-ups applied), `block_rows()` the file's own rows of blocks when it is `native`."""

    __slots__ = ("name", "qtype", "type_name", "native", "_data", "_arch", "_config", "_order")

    def __init__(self, name: str, tensor: Any, arch: str, config: Any, native: bool) -> None:
        self.name = name
        self.qtype = int(tensor.tensor_type)
        self.type_name = tensor.tensor_type.name
        self._data = tensor.data  # np.memmap view of the file: rows of blocks (or of floats)
        self._arch, self._config = arch, config
        file_shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        transposed = len(file_shape) == 2 and transposed_in_file(name, arch)
        # Native where the HF layout is the file's row layout (not GPT-2's transposed Conv1D).
        self.native = native and len(file_shape) == 2 and not transposed and self.type_name != "F64"
        order = row_order(name, arch, config, file_shape[0]) if self.native else None
        self._order = order if order is not None else (np.arange(file_shape[0]) if self.native else None)
        self._raw, self._offset, self.mappable = None, 0, False
        self.shape = torch.Size(file_shape[::-1] if transposed else file_shape)
        self.dtype = torch.float32

    @property
    def quantized(self) -> bool:
        return self.type_name not in FLOAT_TYPES

    def load(self) -> torch.Tensor:
        if self.native:  # rows already in HF order; a 2-D weight has no other fix-up
            return torch.from_numpy(dequantize_rows(self.block_rows().numpy(), self.type_name, self.shape[1]))
        import gguf

        if self.type_name == "F64":
            values = np.asarray(self._data).view(np.float64).astype(np.float32)
        else:
            values = np.asarray(gguf.dequantize(self._data, gguf.GGMLQuantizationType(self.qtype)), dtype=np.float32)
        # Writable memory of its own: an F32 tensor dequantizes to a view of the read-only mapping.
        return torch.from_numpy(np.require(fix_up(values, self.name, self._arch, self._config), np.float32,
                                           ["C", "W", "O"]))

    def block_rows(self, start: int = 0, length: int | None = None) -> torch.Tensor:
        """HF rows [start, start + length) as a uint8 tensor [length, bytes per row] of the file's
        blocks (float tensors: their raw bytes): a view of the mapping, or a copy where llama's
        q/k rows were reordered. Read-only memory: nothing writes a weight."""
        if not self.native:
            raise ValueError(f"{self.name}: not a native GGUF weight")
        length = self.shape[0] - start if length is None else length
        raw = np.asarray(self._data).view(np.uint8).reshape(len(self._data), -1)
        order = self._order[start : start + length]
        contiguous = len(order) == 0 or (order[-1] - order[0] == len(order) - 1 and np.all(np.diff(order) == 1))
        rows = raw[order[0] : order[0] + len(order)] if contiguous and len(order) else raw[order]
        with warnings.catch_warnings():  # a read-only mapping: torch warns that it cannot write it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(rows)

    def rows(self, start: int, length: int) -> GGUFTensor | torch.Tensor:
        """Rows [start, start + length): a native part stays unread blocks, a float one is cut
        from the dequantized whole."""
        if not 0 <= start <= start + length <= self.shape[0]:
            raise IndexError(f"rows [{start}, {start + length}) of a tensor with {self.shape[0]}")
        if not self.native:
            return self.load()[start : start + length]
        part = object.__new__(GGUFTensor)
        for slot in GGUFTensor.__slots__ + CheckpointTensor.__slots__:
            setattr(part, slot, getattr(self, slot))
        part._order = self._order[start : start + length]
        part.shape = torch.Size((length, *self.shape[1:]))
        return part

    def copy_to(self, target: torch.Tensor, dim: int = 0, start: int = 0) -> None:
        target.copy_(self.narrow(dim, start, target.shape[dim]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim % len(self.shape) == 0 and self.native:
            return self.rows(start, length).load()
        return self.load().narrow(dim, start, length)

    def mapped(self) -> None:
        return None


def dequantize_rows(raw: np.ndarray, type_name: str, k: int) -> np.ndarray:
    """Rows of raw GGUF bytes [rows, bytes per row] -> float32 [rows, k]."""
    import gguf

    if raw.shape[0] == 0:
        return np.empty((0, k), np.float32)
    if type_name == "F32":
        return np.ascontiguousarray(raw).view(np.float32).reshape(-1, k).copy()
    if type_name == "F16":
        return np.ascontiguousarray(raw).view(np.float16).reshape(-1, k).astype(np.float32)
    if type_name == "BF16":
        halves = np.ascontiguousarray(raw).view(np.uint16).reshape(-1, k).astype(np.uint32) << 16
        return halves.view(np.float32)
    values = gguf.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[type_name])
    return np.asarray(values, dtype=np.float32).reshape(-1, k)


def iterate_gguf_weights(model_dir: str, config: Any, native: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight of the GGUF a converted directory came from, one at a
    time from the memory-mapped file. MoE expert stacks are dequantized and split per expert
    (the fused experts run in float)."""
    from pagedllm.transformers_utils.gguf_reader import open_gguf_reader, read_tensor_table

    source = gguf_source(model_dir)
    path = source["source"]
    if not os.path.isfile(path):
        raise ValueError(f"the GGUF file {path} that {model_dir} was read from is gone")
    try:  # the metadata is in the converted directory already: only the tensor table is read
        tensors = read_tensor_table(path)
    except ValueError:  # a big-endian file (or a broken one: gguf's own reader says why)
        tensors = open_gguf_reader(path).tensors
    check_tensor_types(tensors, path)
    arch = source["architecture"]
    names = hf_names(arch, config)
    for t in tensors:
        if t.name in IGNORED_TENSORS:
            continue
        hf = names.get(t.name)
        if hf is None:
            raise ValueError(f"Don't know the HF name of GGUF tensor {t.name!r} ({arch})")
        tensor = GGUFTensor(t.name, t, arch, config, native)
        if EXPERTS.match(t.name):
            for name, part in split_experts(tensor.load().numpy(), t.name, hf).items():
                yield name, torch.from_numpy(np.ascontiguousarray(part))
            continue
        yield hf, tensor
