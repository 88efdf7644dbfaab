"""Beam search over the engine: equal to transformers' beam search, EOS handling, validation, KV hygiene."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM
from pagedllm.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, get_beam_search_score
from tests.utils import make_tiny_model

PROMPTS = [[1, 45, 67, 89, 120, 33], [1] + list(range(50, 70))]  # the second spans a full 16-token block


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory) -> tuple[str, LLM]:
    path = make_tiny_model(str(tmp_path_factory.mktemp(request.param)), request.param)
    return path, LLM(path, dtype="float32", kv_cache_memory=1 << 24)


def hf_beam_search(path: str, prompt: list[int], beam_width: int, max_new_tokens: int) -> tuple[list, list]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt]), num_beams=beam_width, max_new_tokens=max_new_tokens, do_sample=False,
        early_stopping=True, length_penalty=1.0, num_return_sequences=beam_width,
        eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
    )
    seqs = [s[len(prompt):].tolist() for s in out.sequences]
    # EOS off: every hypothesis runs the full length (an early EOS would show up as padding here).
    assert all(len(s) == max_new_tokens and -1 not in s for s in seqs)
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("beam_width", [2, 4])
def test_matches_transformers_beam_search(tiny, beam_width):
    path, llm = tiny
    params = BeamSearchParams(beam_width=beam_width, max_tokens=8, ignore_eos=True, length_penalty=1.0)
    outs = llm.beam_search(PROMPTS, params)
    assert len(outs) == len(PROMPTS) and all(isinstance(o, BeamSearchOutput) for o in outs)
    for prompt, out in zip(PROMPTS, outs):
        want, want_scores = hf_beam_search(path, prompt, beam_width, 8)
        got = [s.output_token_ids for s in out.sequences]
        assert got[0] == want[0], f"best beam differs\nours={got}\nhf  ={want}"
        assert got == want  # every returned hypothesis, in HF's order
        for seq, hf_score in zip(out.sequences, want_scores):
            assert seq.tokens[: len(prompt)] == prompt and seq.num_prompt_tokens == len(prompt)
            assert seq.finish_reason == "length" and len(seq.logprobs) == 8
            assert seq.score == pytest.approx(hf_score, abs=1e-3)  # cum_logprob / 8 generated tokens
            steps = zip(seq.logprobs, seq.output_token_ids)
            assert seq.cum_logprob == pytest.approx(sum(lp[t].logprob for lp, t in steps))


def test_beams_are_batched_and_share_cached_prefix(tiny):
    _, llm = tiny
    engine = llm.llm_engine
    calls = []
    real_generate = llm.generate

    def spy(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return real_generate(prompts, *args, **kwargs)

    llm.generate = spy
    try:
        hits_before = engine.get_stats()["prefix_cache_hits"]
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    finally:
        del llm.generate
    # one generate call per step, every live beam of every prompt in it
    assert calls == [2, 6, 6, 6, 6]
    assert engine.get_stats()["prefix_cache_hits"] > hits_before
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_string_prompts_and_text(tiny):
    _, llm = tiny
    tok = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    text_prompt = "Hello, my name is"
    by_text, by_ids = llm.beam_search([text_prompt, tok(text_prompt).input_ids], params)
    assert [s.tokens for s in by_text.sequences] == [s.tokens for s in by_ids.sequences]
    for seq in by_text.sequences:
        assert seq.text == tok.decode(seq.output_token_ids, skip_special_tokens=True)


def test_eos_candidates_complete(tiny, monkeypatch):
    """With length_penalty=0 the score is the cumulative logprob, so a beam that ends at once with the most
    likely first token beats every longer one. Make that token the EOS: it must come back completed."""
    _, llm = tiny
    prompt = PROMPTS[0]
    free = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))[0]
    first_lp = free.sequences[0].logprobs[0]
    eos = max(first_lp, key=lambda t: first_lp[t].logprob)
    monkeypatch.setattr(llm.llm_engine.processor, "eos_token_ids", [eos])
    for include in (False, True):
        params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.0, include_stop_str_in_output=include)
        best, *rest = llm.beam_search([prompt], params)[0].sequences
        assert best.output_token_ids == [eos] and best.finish_reason == "stop"
        assert best.score == pytest.approx(first_lp[eos].logprob)
        assert best.text == (llm.get_tokenizer().decode([eos]) if include else "")
        assert [s.score for s in [best, *rest]] == sorted([s.score for s in [best, *rest]], reverse=True)
        for seq in rest:  # an EOS only ever ends a completed sequence; live ones run to max_tokens
            out = seq.output_token_ids
            if seq.finish_reason == "stop":
                assert out[-1] == eos and eos not in out[:-1]
            else:
                assert seq.finish_reason == "length" and eos not in out and len(out) == 4


def test_stops_at_max_model_len(tiny):
    path, _ = tiny
    small = LLM(path, dtype="float32", kv_cache_memory=1 << 24, max_model_len=10)
    out = small.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))[0]
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert len(seq.tokens) == 10 and seq.finish_reason == "length"
    stats = small.llm_engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_score_convention():
    from pagedllm.entrypoints.beam_search import BeamSearchSequence

    seq = BeamSearchSequence([1, 2, 3, 4, 5], cum_logprob=-6.0, num_prompt_tokens=2)
    assert get_beam_search_score(seq, 1.0) == pytest.approx(-2.0)  # 3 generated tokens, prompt not counted
    assert get_beam_search_score(seq, 0.0) == -6.0
    assert get_beam_search_score(seq, 2.0) == pytest.approx(-6.0 / 9)
    assert math.isfinite(get_beam_search_score(BeamSearchSequence([1], num_prompt_tokens=1), 1.0))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=11, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    ],
)
def test_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


def test_bad_inputs(tiny):
    _, llm = tiny
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search([[1, 2]], {"beam_width": 2})
    with pytest.raises(ValueError, match="empty"):
        llm.beam_search([""], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.beam_search([[1, 10**6]], BeamSearchParams(beam_width=2, max_tokens=2))
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=2)) == []
    stats = llm.llm_engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
