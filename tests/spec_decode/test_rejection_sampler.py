"""Speculative sampling must be lossless: what comes out is distributed as the target's p."""

import pytest
import torch
from scipy.stats import chisquare

from pagedllm.model_executor.layers.sampler import SamplingMetadata
from pagedllm.spec_decode.rejection_sampler import accept_certain, accept_sampled, target_probs


def test_accept_certain_keeps_the_matching_prefix_then_the_targets_token():
    assert accept_certain([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted + bonus
    assert accept_certain([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accept_certain([4], [3, 8]) == [3]


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=gen))


@pytest.mark.parametrize("overlap", ["related", "disjoint_top"])
def test_accept_sampled_output_positions_follow_the_target(overlap):
    """p_j fixed per position (no history), q deliberately different: each output position's
    token must be distributed as p_j, whatever was accepted or resampled before it."""
    gen = torch.Generator().manual_seed(0)
    vocab, k = 6, 3
    p = torch.distributions.Dirichlet(torch.ones(vocab)).sample((k + 1,))
    q = torch.distributions.Dirichlet(torch.ones(vocab) * 0.5).sample((k,))
    if overlap == "disjoint_top":  # the draft loves tokens the target finds unlikely
        q = (1.0 - p[:k]) ** 4
        q /= q.sum(dim=-1, keepdim=True)
    trials = 12000
    counts = torch.zeros(2, vocab)
    lengths = torch.zeros(k + 2)
    for _ in range(trials):
        drafts = [_draw(q[j], gen) for j in range(k)]
        target = [_draw(p[j], gen) for j in range(k + 1)]
        out = accept_sampled(drafts, target, p, q, gen)
        assert 1 <= len(out) <= k + 1 and out[: len(out) - 1] == drafts[: len(out) - 1]
        lengths[len(out)] += 1
        for pos in range(min(2, len(out))):
            counts[pos, out[pos]] += 1
    for pos in range(2):
        n = counts[pos].sum()
        assert chisquare(counts[pos].numpy(), (p[pos] * n).numpy()).pvalue > 1e-3
    # Acceptance rate: sum_x min(p, q) at the first position.
    accept_first = 1 - lengths[1] / trials
    assert abs(accept_first - torch.minimum(p[0], q[0]).sum()) < 0.03


def test_accept_sampled_with_equal_distributions_accepts_everything():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 10, generator=gen), dim=-1)
    for _ in range(200):
        drafts = [_draw(p[j], gen) for j in range(3)]
        assert accept_sampled(drafts, drafts + [7], p, p[:3], gen) == drafts + [7]


def test_target_probs_applies_temperature_top_k_top_p_min_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -5.0]])
    md = SamplingMetadata(temperature=torch.tensor([0.5]), top_k=torch.tensor([3]), top_p=None, greedy=None,
                          all_greedy=False, generators={})
    probs = target_probs(logits, md, torch.tensor([0]))
    expected = torch.softmax(torch.tensor([4.0, 2.0, 0.0]), dim=0)
    torch.testing.assert_close(probs[0, :3], expected)
    assert probs[0, 3:].sum() == 0
    md.top_k, md.top_p = None, torch.tensor([0.8])
    probs = target_probs(logits, md, torch.tensor([0]))
    assert (probs[0] > 0).tolist() == [True, False, False, False, False]  # p = 0.865 ... covers 0.8 alone
    md.top_p, md.min_p = None, torch.tensor([0.1])
    probs = target_probs(logits, md, torch.tensor([0]))  # keep p >= 0.1 * p_max: e^-2 = 0.135, e^-4 < 0.1
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]


def test_target_probs_of_rows_without_top_k_in_a_batch_that_has_some():
    """Rows with top_k off next to rows with it on: only the selected rows' settings apply."""
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    md = SamplingMetadata(temperature=torch.tensor([1.0, 1.0]), top_k=torch.tensor([0, 1]),
                          top_p=torch.tensor([1.0, 0.5]), greedy=None, all_greedy=False, generators={})
    torch.testing.assert_close(target_probs(logits[:1], md, torch.tensor([0]))[0], logits[0].softmax(-1))
    assert target_probs(logits[1:], md, torch.tensor([1]))[0].tolist() == [1.0, 0.0, 0.0]
