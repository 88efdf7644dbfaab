"""Speculative decoding end to end on tiny models: greedy output is identical with and without
speculation (n-gram, a truncated copy of the target, an unrelated draft model), whatever the
batching, chunking, preemption, penalties, logprobs, stop strings or grammars; sampled output
follows the target's distribution (chi-square against probabilities from transformers)."""

from __future__ import annotations

import json

import pytest
import torch
from scipy.stats import chisquare

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.spec_decode.truncated_draft import make_truncated_draft
from tests.utils import make_tiny_model

# Repetitive prompts, so n-gram lookups find something to propose.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
    [30, 31, 32, 33, 34, 35, 36, 37, 30, 31, 32, 33],
    list(range(40, 75)),
    [12, 13, 12, 13, 12, 13, 12],
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def drafts(tiny_llama, tiny_gemma3, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafts")
    return {
        "llama_truncated": make_truncated_draft(tiny_llama, str(root / "llama_trunc"), 2),
        "gemma3_truncated": make_truncated_draft(tiny_gemma3, str(root / "gemma3_trunc"), 2),
        "llama_random": make_tiny_model(str(root / "llama_rand"), "llama", seed=7, num_hidden_layers=1),
    }


def _engine(model: str, spec: dict | None = None, **kwargs) -> LLM:
    return LLM(model, dtype="float32", kv_cache_memory=1 << 24, speculative_config=spec, **kwargs)


def _generate(llm: LLM, params, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_llama, tiny_gemma3) -> dict[str, list[list[int]]]:
    return {name: _ids(_generate(_engine(path), GREEDY)) for name, path in
            (("llama", tiny_llama), ("gemma3", tiny_gemma3))}


@pytest.mark.parametrize("arch,method", [
    ("llama", "ngram"), ("gemma3", "ngram"),
    ("llama", "llama_truncated"), ("gemma3", "gemma3_truncated"), ("llama", "llama_random"),
])
def test_greedy_identical_with_speculation(arch, method, reference, drafts, tiny_llama, tiny_gemma3):
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": drafts[method],
                                             "num_speculative_tokens": 3}
    llm = _engine(tiny_llama if arch == "llama" else tiny_gemma3, spec)
    assert _ids(_generate(llm, GREEDY)) == reference[arch]
    metrics = llm.get_metrics()
    assert metrics["pagedllm:spec_decode_num_draft_tokens"] > 0
    if method != "llama_random":  # a related drafter gets some right
        assert metrics["pagedllm:spec_decode_num_accepted_tokens"] > 0
    assert metrics["pagedllm:kv_cache_usage"] == 0.0  # every block came back


def test_draft_equal_to_target_is_always_accepted(tiny_llama, reference):
    llm = _engine(tiny_llama, {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 4})
    assert _ids(_generate(llm, GREEDY)) == reference["llama"]
    m = llm.get_metrics()
    assert m["pagedllm:spec_decode_acceptance_rate"] > 0.95
    assert m["pagedllm:spec_decode_mean_acceptance_length"] > 4.0


@pytest.mark.parametrize("spec_kind", ["ngram", "draft"])
def test_chunking_preemption_and_prefix_cache_do_not_change_greedy(spec_kind, tiny_llama, drafts, reference):
    """A token budget of 10 cuts drafts and prompts into pieces; 8 blocks of 16 force preemptions;
    the duplicated prompts hit the prefix cache."""
    spec = NGRAM if spec_kind == "ngram" else {"method": "draft_model", "model": drafts["llama_truncated"],
                                                "num_speculative_tokens": 3}
    llm = LLM(tiny_llama, dtype="float32", speculative_config=spec, max_num_batched_tokens=10,
              num_gpu_blocks_override=8, max_model_len=128)
    outs = _ids(_generate(llm, GREEDY, PROMPTS + PROMPTS))
    assert outs == reference["llama"] + reference["llama"]
    assert llm.get_metrics()["pagedllm:num_preemptions"] > 0


def test_logprobs_penalties_and_min_tokens_match_without_speculation(tiny_llama, drafts):
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3, repetition_penalty=1.3,
                            frequency_penalty=0.2, min_tokens=10, bad_words=None)
    base = _generate(_engine(tiny_llama), params)
    for spec in (NGRAM, {"method": "draft_model", "model": drafts["llama_truncated"], "num_speculative_tokens": 3}):
        outs = _generate(_engine(tiny_llama, spec), params)
        for a, b in zip(outs, base):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert la.keys() == lb.keys()
                for tok in la:
                    assert la[tok].logprob == pytest.approx(lb[tok].logprob, abs=1e-4)
                    assert la[tok].rank == lb[tok].rank


def test_tokens_after_a_stop_are_dropped(tiny_llama, reference):
    """Stop tokens and stop strings inside an accepted run of drafts end the output there."""
    tok = _engine(tiny_llama).get_tokenizer()
    ref = reference["llama"][0]
    stop_token = ref[10]
    stop_text = tok.decode(ref[12:14])
    for params in (SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token]),
                   SamplingParams(temperature=0, max_tokens=24, stop=[stop_text]),
                   SamplingParams(temperature=0, max_tokens=13)):
        base = _generate(_engine(tiny_llama), params, PROMPTS[:1])[0].outputs[0]
        spec = _generate(_engine(tiny_llama, {**NGRAM, "num_speculative_tokens": 6}), params, PROMPTS[:1])[0].outputs[0]
        assert (spec.token_ids, spec.text, spec.finish_reason) == (base.token_ids, base.text, base.finish_reason)


def test_structured_output_with_speculation(tiny_llama, drafts):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
    base = _generate(_engine(tiny_llama), params, PROMPTS[:2])
    for spec in (NGRAM, {"method": "draft_model", "model": drafts["llama_truncated"], "num_speculative_tokens": 3}):
        outs = _generate(_engine(tiny_llama, spec), params, PROMPTS[:2])
        assert _ids(outs) == _ids(base)
        for o in outs:
            if o.outputs[0].finish_reason == "stop":
                assert isinstance(json.loads(o.outputs[0].text)["a"], int)


def test_seeded_ngram_sampling_does_not_depend_on_the_batch(tiny_llama):
    llm = _engine(tiny_llama, NGRAM)
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=11, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    alone = _ids(_generate(llm, seeded, PROMPTS[:1]))[0]
    batch = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [seeded, other, other, other], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone


def _exact_marginals(model_dir: str, prompt: list[int], temperature: float, top_k: int) -> tuple[dict, dict]:
    """P(2nd token) and P(3rd token) of the target under temperature/top-k, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def dist(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1] / temperature
        vals, idx = logits.topk(top_k)
        return dict(zip(idx.tolist(), vals.softmax(-1).tolist()))

    second: dict[int, float] = {}
    third: dict[int, float] = {}
    for t1, p1 in dist(prompt).items():
        for t2, p2 in dist(prompt + [t1]).items():
            second[t2] = second.get(t2, 0.0) + p1 * p2
            for t3, p3 in dist(prompt + [t1, t2]).items():
                third[t3] = third.get(t3, 0.0) + p1 * p2 * p3
    return second, third


def _chi_square_pvalue(counts: dict[int, int], probs: dict[int, float]) -> float:
    assert set(counts) <= set(probs), "a token outside the target's top-k came out"
    n = sum(counts.values())
    keys = sorted(probs)
    observed = [counts.get(k, 0) for k in keys]
    expected = [probs[k] * n for k in keys]
    return chisquare(observed, [e * n / sum(expected) for e in expected]).pvalue


def _second_and_third_counts(llm: LLM, prompt: list[int], params: list[SamplingParams]
                             ) -> tuple[dict[int, int], dict[int, int]]:
    """How often each token came out 2nd and 3rd, over one request per params."""
    counts2: dict[int, int] = {}
    counts3: dict[int, int] = {}
    for o in llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False):
        ids = o.outputs[0].token_ids
        counts2[ids[1]] = counts2.get(ids[1], 0) + 1
        counts3[ids[2]] = counts3.get(ids[2], 0) + 1
    return counts2, counts3


def test_sampled_tokens_follow_the_target_distribution(tiny_llama, drafts):
    """2000 seeded draws with a truncated-copy draft (related but different): the 2nd and 3rd
    output tokens (the first ones that go through verification) match the target's marginals."""
    prompt = [5, 6, 7, 8, 9]
    temperature, top_k = 1.5, 4
    second, third = _exact_marginals(tiny_llama, prompt, temperature, top_k)
    llm = _engine(tiny_llama, {"method": "draft_model", "model": drafts["llama_truncated"],
                               "num_speculative_tokens": 2})
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True, seed=s)
              for s in range(2000)]
    counts2, counts3 = _second_and_third_counts(llm, prompt, params)
    m = llm.get_metrics()
    assert 0.05 < m["pagedllm:spec_decode_acceptance_rate"] < 0.99  # both paths (accept, resample) ran
    assert _chi_square_pvalue(counts2, second) > 1e-3
    assert _chi_square_pvalue(counts3, third) > 1e-3


def test_draft_model_with_mixed_sampling_settings_in_one_batch(tiny_llama, drafts):
    """Greedy, top-k and full-vocabulary sampled requests verified in the same steps."""
    llm = _engine(tiny_llama, {"method": "draft_model", "model": drafts["llama_truncated"],
                               "num_speculative_tokens": 3})
    params = [GREEDY,
              SamplingParams(temperature=0.9, top_k=5, max_tokens=24, ignore_eos=True, seed=1),
              SamplingParams(temperature=0.9, top_p=0.8, max_tokens=24, ignore_eos=True, seed=2),
              SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [24] * 4
    assert outs[0].outputs[0].token_ids == _ids(_generate(_engine(tiny_llama), GREEDY, PROMPTS[:1]))[0]



@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forked_samples_with_a_draft_model_match_single_requests(tiny_llama, drafts, prefix_caching):
    """n > 1: the samples that fork the first one's prompt blocks get the draft model's K/V copied
    too, so each proposes and samples as the request alone with its seed."""
    spec = {"method": "draft_model", "model": drafts["llama_truncated"], "num_speculative_tokens": 3}
    llm = _engine(tiny_llama, spec, enable_prefix_caching=prefix_caching)
    common = dict(temperature=1.0, max_tokens=16, ignore_eos=True)
    samples = _generate(llm, SamplingParams(n=3, seed=5, **common), PROMPTS[2:3])[0].outputs
    singles = [_ids(_generate(llm, SamplingParams(seed=5 + i, **common), PROMPTS[2:3]))[0] for i in range(3)]
    assert [s.token_ids for s in samples] == singles
