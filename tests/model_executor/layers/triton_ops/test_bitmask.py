"""The Triton grammar-bitmask kernel against the CPU path (numpy's unpacked bits), at
vocabulary sizes that are and are not multiples of 32, on every row or on some."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.layers.sampler import apply_token_bitmask
from pagedllm.model_executor.layers.triton_ops.bitmask import apply_token_bitmask_inplace


@pytest.mark.parametrize("vocab", [31, 32, 100, 1061, 2049])
@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0], []])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_cpu_path(device, vocab, rows, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen).to(dtype)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64).to(torch.int32)
    expected = logits.clone()
    if rows:
        apply_token_bitmask(expected, bitmask, rows)
    got = logits.to(device)
    apply_token_bitmask_inplace(got, bitmask, torch.tensor(rows, dtype=torch.int64))
    assert torch.equal(got.cpu(), expected)
    if rows:
        assert torch.isinf(expected).any() and not torch.isinf(expected).all()


def test_all_allowed_changes_nothing(device):
    logits = torch.randn(2, 70, device=device)
    before = logits.clone()
    apply_token_bitmask_inplace(logits, torch.full((2, 3), -1, dtype=torch.int32), torch.tensor([0, 1]))
    assert torch.equal(logits, before)
