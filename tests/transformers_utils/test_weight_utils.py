"""Checkpoint tensors are read lazily: whole, or only the slice a tensor-parallel rank keeps
(rows in one read, columns one read per row), with the values safetensors stores."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pagedllm.transformers_utils.weight_utils import iterate_checkpoint, iterate_safetensors


class _CountingFile:
    def __init__(self, raw) -> None:
        self.raw, self.bytes_read, self.reads, self.addresses = raw, 0, [], []

    def seek(self, offset: int) -> None:
        self.raw.seek(offset)

    def readinto(self, buf) -> int:
        n = self.raw.readinto(buf)
        self.bytes_read += n
        self.reads.append(n)
        self.addresses.append(np.frombuffer(buf, np.uint8).ctypes.data)
        return n


def test_slices_read_only_their_bytes(tmp_path):
    w = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    b = torch.arange(5, dtype=torch.bfloat16)
    save_file({"w": w, "b": b}, str(tmp_path / "model.safetensors"))
    assert {n: t.tolist() for n, t in iterate_safetensors(str(tmp_path))} == {"w": w.tolist(), "b": b.tolist()}
    for name, lazy in iterate_checkpoint(str(tmp_path)):
        if name != "w":
            assert lazy.dtype == torch.bfloat16 and torch.equal(lazy[1:4], b[1:4])
            continue
        assert lazy.shape == w.shape and lazy.dtype == torch.float32
        lazy._raw = counting = _CountingFile(lazy._raw)
        assert torch.equal(lazy.narrow(0, 2, 3), w[2:5]) and counting.bytes_read == 3 * 8 * 4
        assert torch.equal(lazy.narrow(1, 4, 4), w[:, 4:]) and counting.bytes_read == 3 * 8 * 4 + 6 * 4 * 4
        assert torch.equal(lazy.load(), w)
        # every column (a row-parallel weight at one rank): one read, not one per row
        counting.reads.clear()
        assert torch.equal(lazy.narrow(1, 0, 8), w) and counting.reads == [6 * 8 * 4]


def test_copy_to_reads_straight_into_the_target(tmp_path):
    """A slice that is one stretch of the file lands in a contiguous target of its dtype with one
    read into the target's own memory; anything else (columns of several rows, another dtype, a
    strided target) takes the copying path, with the same values."""
    w = torch.randn(6, 8)
    save_file({"w": w, "one": w[:1].clone(), "s": torch.tensor(2.5)}, str(tmp_path / "model.safetensors"))
    for name, lazy in iterate_checkpoint(str(tmp_path)):
        lazy._raw = counting = _CountingFile(lazy._raw)
        if name == "s":  # a scalar
            target = torch.zeros(())
            lazy.copy_to(target)
            assert target.item() == 2.5
            continue
        if name == "one":  # a [1, 8] tensor: a column slice is one stretch too
            target = torch.empty(1, 3)
            lazy.copy_to(target, 1, 5)
            assert torch.equal(target, w[:1, 5:]) and counting.addresses == [target.data_ptr()]
            continue
        param = torch.nn.Parameter(torch.full((3, 8), float("nan")))  # as a custom loader might pass it
        with torch.no_grad():
            lazy.copy_to(param, 0, 2)
        assert torch.equal(param, w[2:5]) and counting.addresses == [param.data_ptr()]

        counting.reads.clear()
        counting.addresses.clear()
        whole = torch.empty(6, 8)
        lazy.copy_to(whole, 1, 0)  # every column: the whole tensor, one read
        assert torch.equal(whole, w) and counting.addresses == [whole.data_ptr()]

        cols = torch.empty(6, 3)
        lazy.copy_to(cols, 1, 4)  # columns of several rows: one read per row, then a copy
        assert torch.equal(cols, w[:, 4:7])

        half = torch.empty(2, 8, dtype=torch.bfloat16)
        lazy.copy_to(half, 0, 1)
        assert torch.equal(half, w[1:3].bfloat16())

        strided = torch.empty(8, 4).t()  # [4, 8], not contiguous
        lazy.copy_to(strided, 0, 2)
        assert torch.equal(strided, w[2:6])

        with pytest.raises(IndexError, match=r"\[4, 7\) along dim 0"):
            lazy.copy_to(torch.empty(3, 8), 0, 4)


def test_mapped_rows_are_private_to_the_process(tmp_path, monkeypatch):
    """`mapped()` gives the stored values without reading them, at any offset in the file (the
    mapping starts on a page boundary before it); writing to the tensor leaves the file as it
    was. Only files in a cache that replaces files whole are mapped: elsewhere a file may be
    rewritten in place under the mapping."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    first = torch.arange(7, dtype=torch.float32)  # puts the next tensor off a page boundary
    table = torch.randn(300, 24)
    for where in ("cache", "elsewhere"):
        (tmp_path / where / "model").mkdir(parents=True)
        save_file({"a": first, "table": table}, str(tmp_path / where / "model" / "model.safetensors"))
    lazy = {n: t for n, t in iterate_checkpoint(str(tmp_path / "elsewhere" / "model"))}
    assert lazy["table"].mapped() is None and lazy["a"].mapped() is None

    path = tmp_path / "cache" / "model" / "model.safetensors"
    before = path.read_bytes()
    tensors = {}
    for name, lazy in iterate_checkpoint(str(path.parent)):
        tensors[name] = lazy.rows(10, 200).mapped() if name == "table" else lazy.mapped()
    assert torch.equal(tensors["a"], first) and torch.equal(tensors["table"], table[10:210])
    tensors["table"].fill_(3.0)  # copy-on-write: this process's pages only
    assert path.read_bytes() == before
    assert torch.equal(next(t for n, t in iterate_checkpoint(str(path.parent)) if n == "table").load(), table)
