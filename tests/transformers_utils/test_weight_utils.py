"""Checkpoint tensors are read lazily: whole, or only the slice a tensor-parallel rank keeps
(rows in one read, columns one read per row), with the values safetensors stores."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from pagedllm.transformers_utils.weight_utils import iterate_checkpoint, iterate_safetensors


class _CountingFile:
    def __init__(self, raw) -> None:
        self.raw, self.bytes_read, self.reads = raw, 0, []

    def seek(self, offset: int) -> None:
        self.raw.seek(offset)

    def readinto(self, buf) -> int:
        n = self.raw.readinto(buf)
        self.bytes_read += n
        self.reads.append(n)
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
