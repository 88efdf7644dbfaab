"""GGUFLinear's segments and GGUFRankedHead against the dequantized weights: segments of mixed
types fill their columns of one output, and a ranked head gives each row's top candidates the
blocks' own logits (the argmax and the top values exact), a copy's values only in the tail, and
rows whose logprobs go back to a user the blocks' logits throughout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedllm.forward_context import exact_logit_rows  # noqa: E402
from pagedllm.model_executor.layers import gguf_ops  # noqa: E402
from pagedllm.model_executor.layers.gguf_linear import GGUFLinear, GGUFRankedHead  # noqa: E402
from tests.model_executor.loader.hf_to_gguf import random_blocks  # noqa: E402

T = gguf.GGMLQuantizationType
K = 256


def _tensor(qtype: T, rows: int, seed: int) -> SimpleNamespace:
    raw = torch.from_numpy(random_blocks(qtype, rows, K, seed))
    return SimpleNamespace(name=f"t{seed}", shape=torch.Size((rows, K)), quantized=True, qtype=int(qtype),
                           block_rows=lambda: raw, dense=gguf_ops.gguf_dequantize(int(qtype), raw, K))


def test_segments_of_mixed_types_fill_their_columns() -> None:
    parts = [_tensor(T.Q4_K, 64, 0), _tensor(T.Q8_0, 32, 1), _tensor(T.Q6_K, 32, 2)]
    layer = GGUFLinear(K, 128, torch.float32)
    offset = 0
    for part in parts:
        layer.add(offset, part)
        offset += part.shape[0]
    assert layer.uncovered() == []
    dense = torch.cat([p.dense for p in parts])
    x, bias = torch.randn(5, K), torch.randn(128)
    want = x.double() @ dense.double().T + bias.double()
    got = layer(x, bias)
    assert ((got.double() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K])
def test_ranked_head_keeps_the_top_candidates_exact(qtype) -> None:
    vocab = 4096
    head = _tensor(qtype, vocab, 3)
    blocks = GGUFLinear(K, vocab, torch.float32)
    blocks.add(0, head)
    ranked = GGUFRankedHead.build(blocks, max_rows=4)
    if ranked is None:
        pytest.skip("no int4 kernels here")
    hidden = torch.randn(3, K)
    exact = hidden @ head.dense.T
    logits = ranked(hidden)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    top = exact.topk(16, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(logits, exact, atol=1e-4)  # the tail is the 4-bit copy's
    many = torch.randn(6, K)  # more rows than the 4-bit copy serves: ranked on a W8A8 copy
    exact = many @ head.dense.T
    logits = ranked(many)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    top = exact.topk(4, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [3, 6])  # the 4-bit copy's rows, and the W8A8 copy's
def test_rows_whose_logprobs_are_returned_get_the_blocks_logits(rows) -> None:
    vocab = 4096
    head = _tensor(T.Q6_K, vocab, 4)
    blocks = GGUFLinear(K, vocab, torch.float32)
    blocks.add(0, head)
    ranked = GGUFRankedHead.build(blocks, max_rows=4)
    if ranked is None:
        pytest.skip("no int4 kernels here")
    hidden = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    plain = ranked(hidden)
    with exact_logit_rows(torch.tensor([0, rows - 1])):
        mixed = ranked(hidden)
    exact, own = hidden @ head.dense.T, blocks(hidden)
    for r in (0, rows - 1):  # the blocks' own logits for the whole vocabulary, bar the re-scored top
        assert (mixed[r] != own[r]).sum() <= ranked.top_k
        assert (plain[r] != own[r]).sum() > vocab // 2  # where the plain rows' tail is a copy's
        assert mixed[r].argmax() == exact[r].argmax()
        top = exact[r].topk(16).indices  # the top re-scored as before: the same values
        torch.testing.assert_close(mixed[r, top], plain[r, top])
    assert torch.equal(mixed[1 : rows - 1], plain[1 : rows - 1])  # the other rows as they were
    with exact_logit_rows(None):
        assert torch.equal(ranked(hidden), plain)


def test_ranked_head_from_saved_copies_is_the_same() -> None:
    """What `build` hands to `save` (the loader's on-disk cache) rebuilds the same head: the same
    logits for few rows and many, without quantizing again; copies for another head are refused."""
    vocab = 4096
    blocks = GGUFLinear(K, vocab, torch.float32)
    blocks.add(0, _tensor(T.Q6_K, vocab, 4))
    saved = {}
    made = GGUFRankedHead.build(blocks, max_rows=4, save=saved.update)
    if made is None:
        pytest.skip("no int4 kernels here")
    assert set(saved) == {"few.qweight", "few.scales", "many.qweight", "many.scales"}
    again = GGUFRankedHead.build(blocks, max_rows=4, saved={k: v.clone() for k, v in saved.items()})
    for rows in (2, 7):
        hidden = torch.randn(rows, K)
        assert torch.equal(made(hidden), again(hidden))
    other = GGUFLinear(K, vocab // 2, torch.float32)
    other.add(0, _tensor(T.Q6_K, vocab // 2, 5))
    with pytest.raises(ValueError, match="saved copies of 4096 rows"):
        GGUFRankedHead.build(other, max_rows=4, saved=saved)
