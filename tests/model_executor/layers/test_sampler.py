"""The batched sampler: greedy rows, temperature, top-k / top-p masks, seeded generators."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers.sampler import (
    Sampler,
    SamplingMetadata,
    _inverse_cdf_native,
    apply_top_k_top_p,
    greedy_argmax,
    random_draw,
)


def _md(n, temperature=1.0, top_k=None, top_p=None, greedy=None, generators=None):
    greedy = greedy if greedy is not None else [False] * n
    return SamplingMetadata(
        temperature=torch.full((n,), float(temperature)),
        top_k=None if top_k is None else torch.tensor(top_k),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        greedy=torch.tensor(greedy),
        all_greedy=all(greedy),
        generators=generators or {},
    )


def test_top_k_keeps_exactly_k_per_row():
    logits = torch.randn(3, 50)
    out = apply_top_k_top_p(logits, torch.tensor([1, 5, 0]), None)
    kept = torch.isfinite(out).sum(-1).tolist()
    assert kept == [1, 5, 50]  # 0 = off
    top5 = logits[1].topk(5).indices
    assert set(torch.nonzero(torch.isfinite(out[1])).flatten().tolist()) == set(top5.tolist())


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    out = apply_top_k_top_p(logits, None, torch.tensor([0.7, 1.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]  # 0.5 + 0.3 >= 0.7
    assert torch.isfinite(out[1]).all()
    out = apply_top_k_top_p(logits, torch.tensor([1, 0]), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out).sum(-1).tolist() == [1, 1]


def _sorted_nucleus(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus by sorting the whole row, its running mass in float64: the reference."""
    vals, ids = logits.softmax(-1).sort(-1, descending=True)
    keep = vals.double().cumsum(-1) - vals.double() < top_p.double().unsqueeze(1)
    keep[:, 0] = True
    keep[top_p >= 1] = True
    return torch.zeros_like(keep).scatter_(1, ids, keep)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_top_p_over_a_large_vocabulary_keeps_the_sorted_nucleus_on_every_path(use_kernel, monkeypatch):
    """The C kernel's nucleus (two passes, no sort), and torch's: peaked rows find it in the
    top 256 or 4,096 tokens, flat ones by sorting the whole vocabulary. A row's kept set and
    logits are the reference's whatever path it takes and whatever rows share its batch."""
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    gen = torch.Generator().manual_seed(0)
    vocab = 65536
    rows = []
    for scale in (0.5, 3.0, 6.0, 12.0):  # flat (full sort) ... peaked (the top 256)
        x = torch.randn(4, vocab, generator=gen) * scale
        x[:, :10] += 5
        rows.append(x)
    logits = torch.cat(rows)
    top_p = torch.tensor([0.5, 0.95, 0.999, 1.0] * 4)
    out = apply_top_k_top_p(logits, None, top_p)
    kept = out.isfinite()
    assert torch.equal(kept, _sorted_nucleus(logits, top_p))
    assert torch.equal(out[kept], logits[kept])
    sizes = kept.sum(-1)
    assert sizes[3::4].eq(vocab).all()  # top_p 1.0: off
    assert sizes.max() > 4096 and ((sizes > 256) & (sizes < 4096)).any() and sizes.min() < 256  # each path ran
    for i in range(logits.shape[0]):  # alone, each row keeps the same
        assert torch.equal(apply_top_k_top_p(logits[i : i + 1], None, top_p[i : i + 1]), out[i : i + 1])


def test_the_nucleus_kernel_on_ties_zeros_and_short_mass():
    """cpu_kernels.top_p_keep where its buckets meet edge cases: ties at the boundary (the lower
    index first), zero probabilities (out once the mass is reached), a row whose mass never
    reaches top_p (all kept), and random rows of every spread against the sort."""
    if cpu_kernels.kernels() is None:
        pytest.skip("no C kernels")
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.0, 0.5, 0.0, 0.5], [0.3, 0.3, 0.2, 0.1]])
    keep = cpu_kernels.top_p_keep(probs, torch.tensor([0.5, 0.99, 0.95]))
    assert keep.tolist() == [[True, True, False, False], [False, True, False, True], [True] * 4]
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(48, 20000, generator=gen) * torch.linspace(0.1, 8, 48).unsqueeze(1)
    top_p = torch.rand(48, generator=gen) * 0.98 + 0.01
    assert torch.equal(cpu_kernels.top_p_keep(logits.softmax(-1), top_p), _sorted_nucleus(logits, top_p))


def _draw(logits: torch.Tensor, n: int, top_p: float, temperature: float, seed: int) -> torch.Tensor:
    """n draws from one row under top-p, 2,000 rows a call."""
    out = []
    for start in range(0, n, 2000):
        m = min(2000, n - start)
        sampler = Sampler(torch.Generator().manual_seed(seed + start))
        out.append(sampler(logits.repeat(m, 1), _md(m, temperature=temperature, top_p=[top_p] * m)).sampled_token_ids)
    return torch.cat(out)


def test_top_p_rows_draw_from_their_nucleus_on_both_paths(monkeypatch):
    """Top-p rows (no top-k) draw among their 256 likeliest tokens where the nucleus lies there
    and on the full path where it is wider: either way only nucleus tokens, at the nucleus'
    renormalised probabilities (chi-square, 20,000 draws), and a seeded row draws the same token
    alone as beside rows of the other path."""
    from scipy.stats import chisquare

    from pagedllm.model_executor.layers import sampler as sampler_mod

    full_rows = []
    full_path = sampler_mod.sampling_probs
    monkeypatch.setattr(sampler_mod, "sampling_probs", lambda x, md, rows: full_rows.append(len(rows)) or
                        full_path(x, md, rows))

    vocab, temperature = 4096, 0.8
    gen = torch.Generator().manual_seed(1)
    peaked = torch.randn(vocab, generator=gen) * 2
    peaked[:6] += torch.tensor([14.0, 13.5, 13.0, 12.0, 11.0, 9.0])  # a nucleus of a few tokens
    flat = torch.randn(vocab, generator=gen) * 0.3  # a nucleus of ~1,800 tokens: the full path
    for row, top_p, n in ((peaked, 0.9, 20000), (flat, 0.5, 4000)):
        kept = _sorted_nucleus((row / temperature).unsqueeze(0), torch.tensor([top_p]))[0]
        full_rows.clear()
        out = _draw(row.unsqueeze(0), n, top_p, temperature, seed=3)
        assert kept[out].all()
        assert sum(full_rows) == (0 if kept.sum() < 256 else n)  # the path each row took
        if kept.sum() < 256:
            ids = torch.nonzero(kept).flatten()
            expected = (row[ids] / temperature).softmax(-1).double() * n
            counts = torch.bincount(out, minlength=vocab)[ids].double()
            assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3
        else:
            assert 256 < kept.sum() and out.unique().numel() > 256  # drawn beyond the top 256
    batch, top_ps = torch.stack([flat, peaked, flat]), [0.5, 0.9, 0.5]
    for i in range(3):
        md = _md(3, temperature=temperature, top_p=top_ps, generators={i: torch.Generator().manual_seed(11)})
        mixed = Sampler(torch.Generator().manual_seed(5))(batch, md).sampled_token_ids[i]
        md = _md(1, temperature=temperature, top_p=top_ps[i : i + 1], generators={0: torch.Generator().manual_seed(11)})
        assert Sampler()(batch[i : i + 1], md).sampled_token_ids[0] == mixed


def test_greedy_rows_take_argmax_in_mixed_batch():
    logits = torch.randn(4, 30)
    out = Sampler()(logits, _md(4, greedy=[True, False, True, False])).sampled_token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_sample_frequencies_follow_tempered_top_k_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 20000
    batch = logits.repeat(n, 1)
    gen = torch.Generator().manual_seed(0)
    out = Sampler(gen)(batch, _md(n, temperature=0.7, top_k=[3] * n)).sampled_token_ids
    counts = torch.bincount(out, minlength=5).float() / n
    expected = torch.softmax(logits[0, :3] / 0.7, -1)
    assert counts[3:].sum() == 0
    assert torch.allclose(counts[:3], expected, atol=0.015), (counts, expected)


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 100)

    def draw(batch_logits, row):
        gen = torch.Generator().manual_seed(42)
        md = _md(batch_logits.shape[0], generators={row: gen})
        return int(Sampler(torch.Generator().manual_seed(7))(batch_logits, md).sampled_token_ids[row])

    alone = draw(logits, 0)
    mixed = draw(torch.cat([torch.randn(3, 100), logits, torch.randn(2, 100)]), 3)
    assert alone == mixed


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("vocab", [100, 5000, 4096 + 7, 262144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_is_the_first_maximum(vocab, dtype, use_kernel, monkeypatch):
    """Through pagedllm's C kernel (the torch path where it is not built), and through the
    chunked torch path."""
    built = cpu_kernels.kernels() is not None
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    calls = []
    kernel = cpu_kernels.argmax_rows
    monkeypatch.setattr(cpu_kernels, "argmax_rows", lambda *a: calls.append(1) or kernel(*a))
    x = torch.randn(7, vocab + 10, generator=torch.Generator().manual_seed(0)).to(dtype)[:, 3 : vocab + 3]
    x[1] = 0  # all tied: index 0
    x[2, -1] = 100  # in the short tail chunk
    x[3, vocab // 2] = float("inf")
    x[4] = float("-inf")
    x[5, -3:] = 50  # a tie inside the tail
    x[6, 5] = float("nan")  # NaN wins, as in max()
    x[0, vocab // 3] = x[0, vocab // 3 + 1] = x[0, vocab - 2] = 60  # same lane, other lanes
    assert torch.equal(greedy_argmax(x), x.max(dim=-1).indices)
    assert len(calls) == (1 if use_kernel and built else 0)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_random_draw_follows_the_distribution(use_kernel, monkeypatch):
    """The inverse-CDF draw, through pagedllm's C kernel and through torch: frequencies of an
    unnormalised row, zeros never drawn, mass spread over many of the kernel's 512-value blocks,
    and rows with nothing to draw from."""
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    weights = torch.tensor([3.0, 0.0, 1.0, 0.5, 0.0, 2.5])
    n = 40000
    out = random_draw(weights.repeat(n, 1), {}, torch.Generator().manual_seed(0))
    freq = torch.bincount(out, minlength=6).double() / n
    assert freq[1] == 0 and freq[4] == 0
    assert torch.allclose(freq, weights.double() / weights.sum(), atol=0.01), freq

    vocab, hot = 5000, torch.tensor([0, 511, 512, 2600, 4999])
    row = torch.zeros(vocab)
    row[hot] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    out = random_draw(row.repeat(3000, 1), {}, torch.Generator().manual_seed(1))
    freq = torch.bincount(out, minlength=vocab).double() / 3000
    assert freq.sum() == 1 and freq[hot].sum() == 1
    assert torch.allclose(freq[hot], row[hot].double() / 15, atol=0.03), freq[hot]

    odd = torch.rand(3, 700)
    odd[0, 9] = float("nan")  # a NaN row: its first NaN, as argmax gives it
    odd[1] = 0  # nothing to draw: index 0, as argmax gives it
    odd[2, :650] = 0  # all mass in the last, short block
    got = random_draw(odd, {}, torch.Generator().manual_seed(2)).tolist()
    assert got[:2] == [9, 0] and 650 <= got[2] < 700


def test_the_kernel_draws_what_torch_draws():
    """Same probabilities, same uniform numbers: the same tokens (sums in double either way)."""
    if cpu_kernels.kernels() is None:
        pytest.skip("pagedllm's C kernels are not built here")
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(64, 20000, generator=gen) ** 8  # a few large values, a long thin tail
    probs[:, ::7] = 0
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2**-53
    assert torch.equal(cpu_kernels.sample_from_probs(probs, u), _inverse_cdf_native(probs, u))
