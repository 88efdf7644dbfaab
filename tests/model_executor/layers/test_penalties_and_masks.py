"""Penalties, static masks and min_p on hand-made logits, plus the sampled distribution
after temperature / min_p / top-k / top-p, checked against references computed here with numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.model_executor.layers.penalties import apply_penalties
from pagedllm.model_executor.layers.sampler import Sampler, SamplingMetadata

NEG_INF = float("-inf")


def _md(n, temperature=1.0, greedy=False, top_k=None, top_p=None, min_p=None, **extra) -> SamplingMetadata:
    """Metadata for n rows that all sample (or all take the argmax when greedy)."""
    return SamplingMetadata(
        temperature=None if greedy else torch.full((n,), float(temperature)),
        top_k=None if top_k is None else torch.tensor(top_k),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        greedy=None if greedy else torch.zeros(n, dtype=torch.bool),
        all_greedy=greedy,
        generators={},
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        **extra,
    )


class _CapturingSampler(Sampler):
    """Records the final distribution the random draw is made from."""

    probs: torch.Tensor | None = None

    def _random_draw(self, probs, *args, **kwargs):
        self.probs = probs.clone()
        return super()._random_draw(probs, *args, **kwargs)


def _final_probs(logits: torch.Tensor, md: SamplingMetadata) -> np.ndarray:
    sampler = _CapturingSampler(torch.Generator().manual_seed(0))
    sampler(logits.clone(), md)
    return sampler.probs.double().numpy()


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    e = np.where(finite, np.exp(x - x[finite].max()), 0.0)
    return e / e.sum()


# ---- penalties --------------------------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5, 4.0]])
    out = apply_penalties(logits.clone(), [[0, 1]], [[2, 3, 3]], [0.0], [0.0], [2.0])
    # 0, 1 seen in the prompt; 2, 3 in the output (a repeat counts once); 4, 5 never seen.
    assert out.tolist() == [[1.0, -2.0, 1.5, -4.0, 0.5, 4.0]]


def test_frequency_penalty_is_count_times_penalty_on_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    out = apply_penalties(logits.clone(), [[0, 0, 0]], [[1, 2, 2, 2]], [0.0], [0.5], [1.0])
    assert out.tolist() == [[1.0, 0.5, -0.5, 1.0]]  # the prompt's token 0 is not penalised


def test_presence_penalty_is_subtracted_once_per_output_token():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    out = apply_penalties(logits.clone(), [[3]], [[1, 2, 2, 2]], [0.75], [0.0], [1.0])
    assert out.tolist() == [[1.0, 0.25, 0.25, 1.0]]
    # Negative penalties reward instead.
    out = apply_penalties(logits.clone(), [[3]], [[1]], [-0.5], [0.0], [1.0])
    assert out.tolist() == [[1.0, 1.5, 1.0, 1.0]]


def test_penalties_combine_per_row():
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.0], [2.0, -1.0, 1.0, 0.0], [2.0, -1.0, 1.0, 0.0]])
    out = apply_penalties(
        logits.clone(),
        [[3], [], [0]],
        [[0, 0, 1], [2], []],
        [0.5, 0.0, 1.0],
        [0.25, 1.0, 1.0],
        [2.0, 1.0, 1.5],
    )
    # row 0: rep on 0, 1, 3 → [1, -2, 1, 0]; freq 0.25·[2, 1, 0, 0]; presence 0.5 on 0, 1
    # row 1: token 2 once: 1 - 1; row 2: only repetition, on the prompt's token 0.
    expected = [[1.0 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 1.0, 0.0], [2.0, -1.0, 0.0, 0.0], [2.0 / 1.5, -1.0, 1.0, 0.0]]
    assert torch.allclose(out, torch.tensor(expected), atol=1e-6), out


def test_sampler_applies_penalties_only_to_penalty_rows():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    md = _md(
        2, greedy=True, penalty_rows=[1], prompt_token_ids=[[0]], output_token_ids=[[]],
        presence_penalties=[0.0], frequency_penalties=[0.0], repetition_penalties=[1.2],
    )
    assert Sampler()(logits.clone(), md).sampled_token_ids.tolist() == [0, 1]  # 3 / 1.2 = 2.5 < 2.9


# ---- static bias, allowed tokens, banned ids ---------------------------------------------------------------

def test_logit_bias_is_additive():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    bias = torch.tensor([0.0, -3.0, 1.0, 0.0])
    probs = _final_probs(logits, _md(1, static_bias={0: bias}))
    assert np.allclose(probs[0], _softmax([1.0, -1.0, 1.5, -1.0]), atol=1e-6)


def test_allowed_tokens_bias_masks_everything_else():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0, 3.0]])
    bias = torch.full((5,), NEG_INF)
    bias[[1, 3]] = 0.0
    probs = _final_probs(logits, _md(1, static_bias={0: bias}))
    assert np.allclose(probs[0], _softmax([NEG_INF, 1.0, NEG_INF, 0.0, NEG_INF]), atol=1e-6)
    greedy = Sampler()(logits.clone(), _md(1, greedy=True, static_bias={0: bias}))
    assert greedy.sampled_token_ids.tolist() == [1]


def test_banned_ids_are_never_chosen_and_other_rows_are_untouched():
    logits = torch.tensor([[5.0, 4.0, 3.0], [5.0, 4.0, 3.0]])
    md = _md(2, greedy=True, banned_token_ids={0: [0, 1]})
    assert Sampler()(logits.clone(), md).sampled_token_ids.tolist() == [2, 0]
    probs = _final_probs(logits, _md(2, banned_token_ids={1: [0]}))
    assert probs[1, 0] == 0.0 and np.allclose(probs[1], _softmax([NEG_INF, 4.0, 3.0]), atol=1e-6)
    assert np.allclose(probs[0], _softmax([5.0, 4.0, 3.0]), atol=1e-6)


def test_bias_then_penalties_order_and_raw_logprobs():
    """vLLM's order: static bias before penalties; returned logprobs are the raw model's."""
    logits = torch.tensor([[1.0, 2.0, 0.0, -0.5]])
    bias = torch.tensor([3.0, 0.0, 0.0, 0.0])
    md = _md(
        1, static_bias={0: bias}, banned_token_ids={0: [3]}, max_num_logprobs=2, penalty_rows=[0],
        prompt_token_ids=[[0]], output_token_ids=[[]], presence_penalties=[0.0], frequency_penalties=[0.0],
        repetition_penalties=[2.0],
    )
    sampler = _CapturingSampler(torch.Generator().manual_seed(0))
    out = sampler(logits.clone(), md)
    # (1 + 3) / 2 = 2; the penalty would give 0.5 + 3 = 3.5 in the other order.
    assert np.allclose(sampler.probs[0].double().numpy(), _softmax([2.0, 2.0, 0.0, NEG_INF]), atol=1e-6)
    raw = torch.log_softmax(logits[0], -1)
    tok = int(out.sampled_token_ids[0])
    assert out.logprob_token_ids[0].tolist() == [tok, 1, 0]
    assert torch.allclose(out.logprobs[0], raw[[tok, 1, 0]], atol=1e-6)
    assert int(out.sampled_ranks[0]) == int((raw > raw[tok]).sum()) + 1


# ---- min_p ------------------------------------------------------------------------------------------------

def test_min_p_keeps_tokens_with_p_at_least_min_p_times_p_max():
    logits = torch.log(torch.tensor([[0.40, 0.25, 0.15, 0.11, 0.05, 0.04]]))
    # threshold 0.3 · 0.40 = 0.12: 0.40, 0.25, 0.15 stay; 0.11 (just below) and the rest go.
    probs = _final_probs(logits, _md(1, min_p=[0.3]))
    want = np.array([0.40, 0.25, 0.15, 0, 0, 0]) / 0.80
    assert np.allclose(probs[0], want, atol=1e-6), probs
    # min_p = 0 is off; min_p = 1 keeps only the top token.
    probs = _final_probs(logits.repeat(2, 1), _md(2, min_p=[0.0, 1.0]))
    assert np.allclose(probs[0], _softmax(logits[0].numpy()), atol=1e-6)
    assert probs[1].tolist() == [1.0, 0, 0, 0, 0, 0]


def test_seeded_rows_with_different_top_k_stay_in_their_top_k_and_match_alone():
    """Regression: with every row seeded, the draw of a row with k below the batch's largest k
    read uninitialised noise past its k (0 / 0 = NaN won the argmax): tokens outside the top-k."""
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    top3 = set(logits[0].topk(3).indices.tolist())

    def md(n, ks, seed):
        gens = {i: torch.Generator().manual_seed(seed * 10 + i) for i in range(n)}
        return SamplingMetadata(
            temperature=torch.ones(n), top_k=torch.tensor(ks), top_p=None, greedy=torch.zeros(n, dtype=torch.bool),
            all_greedy=False, generators=gens,
        )

    for seed in range(50):
        both = Sampler()(logits.clone(), md(2, [3, 40], seed)).sampled_token_ids.tolist()
        alone = Sampler()(logits[:1].clone(), md(1, [3], seed)).sampled_token_ids.tolist()
        assert both[0] in top3 and both[0] == alone[0], seed


# ---- statistical checks of the sampled distribution ---------------------------------------------------------

_LOGITS = np.array([2.0, 1.6, 1.1, 0.8, 0.3, 0.0, -0.6, -1.2])
N_DRAWS = 40_000


def _reference(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """Independent numpy version of vLLM's order: temperature → min_p → top-k → top-p, renormalising."""
    x = _LOGITS / temperature
    p = _softmax(x)
    keep = np.ones_like(p, dtype=bool)
    if min_p:
        keep &= p >= min_p * p.max()
    if top_k:
        kth = np.sort(x[keep])[::-1][min(top_k, keep.sum()) - 1]
        keep &= x >= kth
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        mass_above = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])
        # Stay away from the boundary, where float rounding may decide either way.
        assert np.all(np.abs(mass_above - top_p) > 1e-3)
        nucleus = np.zeros_like(keep)
        nucleus[order[mass_above < top_p]] = True
        keep &= nucleus
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def _empirical(temperature, top_k=0, top_p=1.0, min_p=0.0, seed=1234) -> np.ndarray:
    v = len(_LOGITS)
    logits = torch.tensor(_LOGITS, dtype=torch.float32).repeat(N_DRAWS, 1)
    md = _md(
        N_DRAWS, temperature=temperature, top_k=[top_k] * N_DRAWS if top_k else None,
        top_p=[top_p] * N_DRAWS if top_p < 1.0 else None, min_p=[min_p] * N_DRAWS if min_p else None,
    )
    ids = Sampler(torch.Generator().manual_seed(seed))(logits, md).sampled_token_ids
    return np.bincount(ids.numpy(), minlength=v) / N_DRAWS


def _assert_matches(freq: np.ndarray, want: np.ndarray) -> None:
    """Each token's frequency is a mean of N Bernoulli(p) draws: its standard error is
    sqrt(p(1-p)/N). Four standard errors leave ~6e-5 two-sided chance per token of a false
    failure for a correct sampler (and the draws are seeded, so the outcome is fixed), while
    any wrong renormalisation or an off-by-one in a mask shifts some token by far more."""
    assert np.all(freq[want == 0] == 0), (freq, want)  # masked tokens are never drawn
    se = np.sqrt(want * (1 - want) / N_DRAWS)
    assert np.all(np.abs(freq - want) <= 4 * se + 1e-12), (freq, want, np.abs(freq - want) / np.maximum(se, 1e-12))


@pytest.mark.parametrize(
    "kwargs, support",
    [
        (dict(temperature=0.8, top_k=3), 3),
        (dict(temperature=1.0, top_p=0.7), 3),
        (dict(temperature=1.3, min_p=0.25), 5),
        (dict(temperature=1.2, min_p=0.15, top_k=5, top_p=0.85), 4),
    ],
    ids=["top_k", "top_p", "min_p", "combined"],
)
def test_sampled_frequencies_match_renormalised_distribution(kwargs, support):
    want = _reference(**kwargs)
    assert (want > 0).sum() == support  # the case really truncates (and the reference agrees)
    _assert_matches(_empirical(**kwargs), want)


def test_unmasked_frequencies_follow_tempered_softmax():
    want = _reference(temperature=0.6)
    assert math.isclose(want.sum(), 1.0) and (want > 0).all()
    _assert_matches(_empirical(temperature=0.6), want)
