"""A tensor of a safetensors file, read only when (and as far as) a weight loader asks: whole,
a slice of rows or columns, straight into the target parameter, or as a copy-on-write map.
`gguf_weights.GGUFTensor` is one too, over a GGUF file's blocks."""

from __future__ import annotations

import mmap

import torch


class CheckpointTensor:
    """A tensor in a safetensors file, not read yet: `load()` reads all of it, `narrow(dim, ...)`
    and `[a:b]` only a slice (rows are one read; columns of a matrix one read per row)."""

    __slots__ = ("_raw", "_offset", "shape", "dtype", "mappable")

    def __init__(self, raw, info: dict, data_start: int, mappable: bool = False) -> None:
        self._raw = raw
        self.mappable = mappable
        self._offset = data_start + info["data_offsets"][0]
        self.shape = torch.Size(info["shape"])
        self.dtype = _DTYPES[info["dtype"]]

    def _read(self, offset: int, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """`count` elements from element `offset`, as a flat tensor: read into `out` (contiguous,
        this dtype, `count` elements, on CPU) when given, else into new memory."""
        if out is None:
            out = torch.empty(count, dtype=self.dtype)
        if count:
            view = out.detach().view(-1).view(torch.uint8).numpy()
            self._raw.seek(self._offset + offset * out.element_size())
            if self._raw.readinto(view) != view.nbytes:
                raise ValueError("checkpoint file ends inside a tensor")
        return out

    def load(self) -> torch.Tensor:
        return self._read(0, self.shape.numel()).view(self.shape)

    def copy_to(self, target: torch.Tensor, dim: int = 0, start: int = 0) -> None:
        """`target.copy_(self.narrow(dim, start, target.shape[dim]))`, read from the file straight
        into `target` when the slice is one stretch of the file and `target` one of memory of the
        same dtype: no staging buffer, no second copy (the 262k-row embedding is 671 MB in float32)."""
        if not self.shape:  # a scalar
            target.copy_(self.load())
            return
        dim %= len(self.shape)
        length = target.shape[dim]
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise IndexError(f"[{start}, {start + length}) along dim {dim} of a tensor of shape {tuple(self.shape)}")
        inner = self.shape[dim + 1 :].numel()
        one_stretch = self.shape[:dim].numel() == 1 or (start == 0 and length == self.shape[dim])
        if not (one_stretch and target.is_contiguous() and target.dtype == self.dtype and target.device.type == "cpu"
                and tuple(target.shape) == (*self.shape[:dim], length, *self.shape[dim + 1 :])):
            target.copy_(self.narrow(dim, start, length))
            return
        self._read(start * inner, target.numel(), out=target)

    def mapped(self) -> torch.Tensor | None:
        """The tensor as a private (copy-on-write) memory map of the file: nothing is read until
        a page is touched, and the pages stay shared with the page cache (and with every other
        process mapping the file) until one is written. Kept alive by the tensor. None where
        the file may be rewritten in place while mapped (a page past a truncation is a SIGBUS;
        one not yet touched would show the new contents), or the data is not aligned to its
        dtype: only files written whole and renamed into place are mapped, pagedllm's cache
        (GGUF conversions) and the Hugging Face hub cache."""
        itemsize = self.dtype.itemsize
        if not self.mappable or self._offset % itemsize:
            return None
        nbytes = self.shape.numel() * itemsize
        start = self._offset - self._offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(self._raw.fileno(), self._offset - start + nbytes, access=mmap.ACCESS_COPY, offset=start)
        return torch.frombuffer(mapping, dtype=self.dtype, count=self.shape.numel(),
                                offset=self._offset - start).view(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim %= len(self.shape)
        inner = self.shape[dim + 1 :].numel()
        if start == 0 and length == self.shape[dim]:  # all of it (a row-parallel weight at one rank): one read
            return self.load()
        if dim == 0:
            return self._read(start * inner, length * inner).view(length, *self.shape[1:])
        rows = self.shape[:dim].numel()
        row = self.shape[dim:].numel()
        parts = [self._read(r * row + start * inner, length * inner) for r in range(rows)]
        return torch.cat(parts).view(*self.shape[:dim], length, *self.shape[dim + 1 :])

    def rows(self, start: int, length: int) -> CheckpointTensor:
        """Rows [start, start + length) as a CheckpointTensor of their own, still unread (a fused
        checkpoint tensor split into the parts that load separately)."""
        if not 0 <= start <= start + length <= self.shape[0]:
            raise IndexError(f"rows [{start}, {start + length}) of a tensor with {self.shape[0]}")
        part = object.__new__(CheckpointTensor)
        itemsize = self.dtype.itemsize
        part._raw, part.dtype, part.mappable = self._raw, self.dtype, self.mappable
        part._offset = self._offset + start * self.shape[1:].numel() * itemsize
        part.shape = torch.Size((length, *self.shape[1:]))
        return part

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, stop, step = index.indices(self.shape[0])
        if step != 1:
            raise IndexError("only contiguous row slices")
        return self.narrow(0, start, max(0, stop - start))


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
