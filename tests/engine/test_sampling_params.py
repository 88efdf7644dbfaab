"""SamplingParams end to end through `LLM` on the tiny float32 models: logprobs against
transformers, penalties / biases / masks against a transformers reference loop, seeds, n and
best_of, stop strings, detokenization, truncation and validation."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.utils import hf_greedy

PROMPT = "Paged attention stores keys and values in fixed-size blocks."
FOX = "The quick brown fox"  # greedy: one token repeated
CAFE = "Unicode: caf"  # greedy: ' He He He He' then 'ea' repeated
KV = 1 << 24


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


@pytest.fixture(scope="module")
def hf_model(tiny_gemma3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()


def _gen(llm, prompt, **kwargs):
    return llm.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)[0]


def _greedy(llm, prompt, max_tokens=10, **kwargs):
    return _gen(llm, prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs).outputs[0]


@torch.inference_mode()
def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log_softmax of one transformers forward pass (row p predicts p + 1)."""
    return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)


@torch.inference_mode()
def _ref_greedy(hf_model, prompt: list[int], n: int, transform) -> list[int]:
    """Greedy decoding with transformers, `transform(logits, prompt, output)` applied to
    each step's logits; asserts the argmax is never a near-tie (the case is well posed)."""
    out: list[int] = []
    for _ in range(n):
        logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].double()
        logits = transform(logits.clone(), prompt, out)
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] > 1e-3 or not math.isfinite(float(top2[1])), "near-tie: pick another case"
        out.append(int(logits.argmax()))
    return out


def _num_repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def _assert_all_blocks_free(llm) -> None:
    stats = llm.llm_engine.get_stats()
    assert not llm.llm_engine.has_unfinished_requests()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


# ---- logprobs -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", kv_cache_memory=KV)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_sample_logprobs_match_transformers(request, arch):
    llm = request.getfixturevalue("llm" if arch == "gemma3" else "llama_llm")
    model_dir = request.getfixturevalue(f"tiny_{arch}")
    tok = llm.get_tokenizer()
    ids = tok(PROMPT).input_ids
    out = _gen(llm, ids, temperature=0, max_tokens=8, logprobs=5, ignore_eos=True).outputs[0]
    ref = hf_greedy(model_dir, [ids], 8)[0]
    assert out.token_ids == ref["tokens"]
    assert len(out.logprobs) == 8
    for tok_id, entry, lp in zip(out.token_ids, out.logprobs, ref["logprobs"]):
        top = lp.topk(5)
        assert set(entry) == {tok_id} | set(top.indices.tolist())
        assert entry[tok_id].rank == 1  # greedy: the sampled token is the top one
        for rank, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[i].rank == rank
            assert abs(entry[i].logprob - v) < 1e-3
            assert entry[i].decoded_token == tok.decode([i])
    total = sum(entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs))
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-6)
    assert out.cumulative_logprob < 0


def test_sampled_token_outside_top_k_keeps_its_true_rank(llm, tok, hf_model):
    """logit_bias forces a poor token; logprobs are the model's raw ones, with that token's real rank."""
    ids = tok(PROMPT).input_ids
    forced = int(_hf_logprobs(hf_model, ids)[-1].argmin())  # the model's least likely next token
    out = _gen(llm, ids, temperature=0, max_tokens=3, logprobs=2, ignore_eos=True, logit_bias={forced: 100.0})
    out = out.outputs[0]
    assert out.token_ids == [forced] * 3
    ref = _hf_logprobs(hf_model, ids + out.token_ids)[len(ids) - 1 : -1]
    for entry, lp in zip(out.logprobs, ref):
        rank = int((lp > lp[forced]).sum()) + 1
        assert rank > 2 and len(entry) == 3
        assert entry[forced].rank == rank
        assert abs(entry[forced].logprob - float(lp[forced])) < 1e-3
        top = lp.topk(2)
        assert [entry[i].rank for i in top.indices.tolist()] == [1, 2]
    assert math.isclose(out.cumulative_logprob, sum(e[forced].logprob for e in out.logprobs), abs_tol=1e-6)


def test_prompt_logprobs_match_transformers_with_and_without_chunking(llm, tok, hf_model, tiny_gemma3):
    ids = tok(PROMPT).input_ids
    assert len(ids) > 12
    params = dict(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    got = _gen(llm, ids, **params).prompt_logprobs
    ref = _hf_logprobs(hf_model, ids)
    assert len(got) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        entry, lp, actual = got[pos], ref[pos - 1], ids[pos]
        assert actual in entry
        assert abs(entry[actual].logprob - float(lp[actual])) < 1e-3
        assert entry[actual].rank == int((lp > lp[actual]).sum()) + 1
        top = lp.topk(3)
        for rank, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[i].logprob == pytest.approx(v, abs=1e-3) and (i == actual or entry[i].rank == rank)
        assert set(entry) == {actual} | set(top.indices.tolist())

    # Again: the prompt is in the prefix cache now, yet every position still gets its logprobs.
    assert _flatten(_gen(llm, ids, **params).prompt_logprobs) == pytest.approx(_flatten(got), abs=1e-5)
    chunked = LLM(tiny_gemma3, dtype="float32", kv_cache_memory=KV, max_num_batched_tokens=4)
    chunked_lp = _gen(chunked, ids, **params).prompt_logprobs
    assert [None if e is None else sorted(e) for e in chunked_lp] == [None if e is None else sorted(e) for e in got]
    assert _flatten(chunked_lp) == pytest.approx(_flatten(got), abs=1e-5)
    _assert_all_blocks_free(chunked)


def test_prompt_logprobs_survive_preemption_mid_prefill(llm, tok, tiny_gemma3):
    """Regression: a request preempted in the middle of its chunked prefill recomputes the
    prompt; its prompt logprobs were appended a second time (51 entries for 30 tokens)."""
    text = PROMPT + " Hello, my name is Ada and I like tea, cake and numbers 0123456789."
    ids = tok(text).input_ids
    first, second = ids[:40], ids[-30:]
    params = SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=1, ignore_eos=True)
    want = [o.prompt_logprobs for o in llm.generate([first, second], params, use_tqdm=False)]
    # 4 blocks of 16: the first request's 49th token needs the block the second holds mid-prefill.
    small = LLM(tiny_gemma3, dtype="float32", num_gpu_blocks_override=4, block_size=16,
                max_num_batched_tokens=4, max_model_len=64)
    outs = small.generate([first, second], params, use_tqdm=False)
    assert small.llm_engine.get_stats()["num_preemptions"] >= 1
    for out, ref, prompt in zip(outs, want, (first, second)):
        assert len(out.prompt_logprobs) == len(prompt)
        assert _flatten(out.prompt_logprobs) == pytest.approx(_flatten(ref), abs=1e-5)
    _assert_all_blocks_free(small)


def _flatten(prompt_logprobs) -> list[float]:
    return [e[t].logprob for e in prompt_logprobs[1:] for t in sorted(e)]


# ---- penalties, biases and masks on the real engine --------------------------------------------------------

def _repetition(r):
    def f(logits, prompt, out):
        for t in set(prompt + out):
            logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
        return logits
    return f


def _frequency(f_pen):
    def f(logits, prompt, out):
        for t in out:
            logits[t] -= f_pen
        return logits
    return f


def _presence(p_pen):
    def f(logits, prompt, out):
        for t in set(out):
            logits[t] -= p_pen
        return logits
    return f


@pytest.mark.parametrize(
    "kwargs, transform",
    [
        (dict(repetition_penalty=2.0), _repetition(2.0)),
        (dict(frequency_penalty=2.0), _frequency(2.0)),
        (dict(presence_penalty=2.0), _presence(2.0)),
        # At 1.0 a token may repeat, so counting occurrences (frequency) and not (presence) differ.
        (dict(frequency_penalty=1.0), _frequency(1.0)),
        (dict(presence_penalty=1.0), _presence(1.0)),
    ],
    ids=["repetition", "frequency", "presence", "frequency_1", "presence_1"],
)
def test_penalties_reduce_repeats_and_match_reference(llm, tok, hf_model, kwargs, transform):
    ids = tok(FOX).input_ids
    plain = _greedy(llm, ids, 12).token_ids
    assert _num_repeats(plain) >= 10
    got = _greedy(llm, ids, 12, **kwargs).token_ids
    assert got != plain and _num_repeats(got) < _num_repeats(plain)
    assert got == _ref_greedy(hf_model, ids, 12, transform)


def test_presence_and_frequency_penalties_differ(llm, tok):
    ids = tok(FOX).input_ids
    presence = _greedy(llm, ids, 12, presence_penalty=1.0).token_ids
    assert presence != _greedy(llm, ids, 12, frequency_penalty=1.0).token_ids


def test_logit_bias_forces_token(llm, tok):
    ids = tok(FOX).input_ids
    assert 100 not in _greedy(llm, ids).token_ids
    assert _greedy(llm, ids, logit_bias={100: 100.0}).token_ids == [100] * 10
    # A large negative bias bans the greedy token.
    first = _greedy(llm, ids).token_ids[0]
    assert first not in _greedy(llm, ids, logit_bias={first: -100.0}).token_ids


def test_allowed_token_ids(llm, tok, hf_model):
    ids = tok(FOX).input_ids
    plain = _greedy(llm, ids).token_ids
    a, b = [t for t in (100, 150, 200) if t not in plain][:2]
    got = _greedy(llm, ids, allowed_token_ids=[a, b]).token_ids
    assert set(got) <= {a, b}

    def only_ab(logits, prompt, out):
        mask = torch.full_like(logits, float("-inf"))
        mask[[a, b]] = 0.0
        return logits + mask

    assert got == _ref_greedy(hf_model, ids, 10, only_ab)


def test_bad_words_never_appear(llm, tok, hf_model):
    ids = tok(CAFE).input_ids
    plain = _greedy(llm, ids, 12)
    word = "He"
    banned = {tok(w, add_special_tokens=False).input_ids[0] for w in (word, " " + word)}
    assert all(len(tok(w, add_special_tokens=False).input_ids) == 1 for w in (word, " " + word))
    assert banned & set(plain.token_ids) and word in plain.text
    got = _greedy(llm, ids, 12, bad_words=[word])
    assert not banned & set(got.token_ids)

    def ban(logits, prompt, out):
        logits[list(banned)] = float("-inf")
        return logits

    assert got.token_ids == _ref_greedy(hf_model, ids, 12, ban)


def test_multi_token_bad_word_bans_only_its_last_token_after_the_prefix(llm, tok):
    ids = tok("Schedulers batch requests;").input_ids
    plain = _greedy(llm, ids, 8).token_ids
    sch = tok("Sch", add_special_tokens=False).input_ids
    assert len(sch) == 1 and plain[:2] == sch * 2  # 'SchSch...'
    word = tok.decode(sch * 2)
    assert tok(word, add_special_tokens=False).input_ids == sch * 2
    got = _greedy(llm, ids, 8, bad_words=[word]).token_ids
    assert got[0] == sch[0]  # the first token of the word is fine on its own
    assert all(got[i : i + 2] != sch * 2 for i in range(len(got) - 1))


def test_min_tokens_holds_back_stop_token(llm, tok, hf_model):
    ids = tok(PROMPT).input_ids
    plain = _greedy(llm, ids, 12).token_ids
    stop_tok = plain[0]
    early = _gen(llm, ids, temperature=0, max_tokens=12, stop_token_ids=[stop_tok]).outputs[0]
    assert early.token_ids == [stop_tok] and early.finish_reason == "stop" and early.stop_reason == stop_tok

    out = _gen(llm, ids, temperature=0, max_tokens=12, stop_token_ids=[stop_tok], min_tokens=4).outputs[0]
    assert len(out.token_ids) >= 4 and stop_tok not in out.token_ids[:4]

    def ban_first_4(logits, prompt, output):
        if len(output) < 4:
            logits[stop_tok] = float("-inf")
        return logits

    ref = _ref_greedy(hf_model, ids, 12, ban_first_4)
    if stop_tok in ref[4:]:
        ref = ref[: ref.index(stop_tok, 4) + 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == ref


def test_min_tokens_holds_back_eos(llm, tok):
    eos = tok.eos_token_id
    out = _gen(llm, tok(FOX).input_ids, temperature=0, max_tokens=10, min_tokens=3, logit_bias={eos: 100.0})
    out = out.outputs[0]
    assert len(out.token_ids) == 4 and eos not in out.token_ids[:3]
    assert out.token_ids[3] == eos and out.finish_reason == "stop"


def test_logits_processors_two_and_three_args(llm, tok):
    ids = tok(FOX).input_ids
    seen = []

    def force_42(output_ids, logits):
        seen.append(list(output_ids))
        forced = torch.full_like(logits, float("-inf"))
        forced[42] = 0.0
        return forced

    out = _greedy(llm, ids, 5, logits_processors=[force_42]).token_ids
    assert out == [42] * 5
    assert seen == [[42] * i for i in range(5)]

    def echo_prompt(prompt_ids, output_ids, logits):
        logits[:] = float("-inf")
        logits[prompt_ids[len(output_ids)]] = 0.0
        return logits

    assert _greedy(llm, ids, 4, logits_processors=[echo_prompt]).token_ids == ids[:4]
    # Sampling rows get them too, and a later processor sees the earlier one's result.
    out = _gen(llm, ids, temperature=1.0, seed=0, max_tokens=4, logits_processors=[echo_prompt, force_42])
    assert out.outputs[0].token_ids == [42] * 4


# ---- seeds, n and best_of ------------------------------------------------------------------------------------

def test_seed_independent_of_batch(llm, tok):
    target = tok(CAFE).input_ids
    others = [tok(PROMPT).input_ids, tok(FOX).input_ids, [5, 6, 7]]
    for seeded in (SamplingParams(temperature=1.0, seed=123, max_tokens=10, ignore_eos=True),
                   SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True)):
        alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
        batch = llm.generate(
            [others[0], target, others[1], others[2]],
            [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), seeded,
             SamplingParams(temperature=0.7, top_k=50, seed=9, max_tokens=6, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)],
            use_tqdm=False,
        )
        assert batch[1].outputs[0].token_ids == alone
        other_seed = SamplingParams(**{**_fields(seeded), "seed": seeded.seed + 1000})
        assert llm.generate(target, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    _assert_all_blocks_free(llm)


def _fields(p: SamplingParams) -> dict:
    return dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed, max_tokens=p.max_tokens,
                ignore_eos=True)


def test_top_k_beyond_vocab_is_off(llm, tok):
    ids = tok(CAFE).input_ids
    big = _gen(llm, ids, temperature=1.0, top_k=10_000, seed=11, max_tokens=6).outputs[0].token_ids
    assert big == _gen(llm, ids, temperature=1.0, seed=11, max_tokens=6).outputs[0].token_ids


def test_n_with_seed_is_reproducible(llm, tok):
    ids = tok(CAFE).input_ids
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    first = _gen(llm, ids, **_n_kwargs(params))
    second = _gen(llm, ids, **_n_kwargs(params))
    assert [c.index for c in first.outputs] == [0, 1, 2]
    tokens = [c.token_ids for c in first.outputs]
    assert tokens == [c.token_ids for c in second.outputs]
    assert len({tuple(t) for t in tokens}) == 3  # the samples use different seeds
    # Sample i is seeded with seed + i (as vLLM), so sample 0 is the single request with the seed.
    single = _gen(llm, ids, temperature=1.0, seed=42, max_tokens=8, ignore_eos=True).outputs[0]
    assert single.token_ids == tokens[0]
    assert all(c.text == tok.decode(c.token_ids) for c in first.outputs)
    _assert_all_blocks_free(llm)


def _n_kwargs(p: SamplingParams) -> dict:
    return dict(n=p.n, temperature=p.temperature, seed=p.seed, max_tokens=p.max_tokens, ignore_eos=True)


def test_best_of_returns_best_n_by_cumulative_logprob(llm, tok):
    ids = tok(CAFE).input_ids
    out = _gen(llm, ids, n=2, best_of=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    assert len(out.outputs) == 2 and [c.index for c in out.outputs] == [0, 1]
    cums = [c.cumulative_logprob for c in out.outputs]
    assert cums[0] >= cums[1]
    assert all(c.logprobs is None for c in out.outputs)  # not asked for
    # The 4 candidates, one by one: sample i uses seed 7 + i.
    singles = [
        _gen(llm, ids, temperature=1.0, seed=7 + i, max_tokens=6, ignore_eos=True, logprobs=0).outputs[0]
        for i in range(4)
    ]
    best = sorted(singles, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert cums == pytest.approx([c.cumulative_logprob for c in best], abs=1e-5)
    _assert_all_blocks_free(llm)


def test_n_above_max_n_is_rejected(llm, tok):
    ids = tok(CAFE).input_ids
    with pytest.raises(ValueError, match=r"n \(129\) .*max_n \(128\)"):
        _gen(llm, ids, n=129, temperature=1.0, max_tokens=1)
    with pytest.raises(ValueError, match=r"best_of \(200\) .*max_n \(128\)"):
        _gen(llm, ids, n=1, best_of=200, temperature=1.0, max_tokens=1)
    assert len(_gen(llm, ids, n=128, temperature=1.0, max_tokens=1).outputs) == 128
    _assert_all_blocks_free(llm)


def test_best_of_needs_sampling():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=1, best_of=2, temperature=0)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=2, temperature=0)
    SamplingParams(n=2, best_of=3, temperature=0.5)


# ---- stop strings and detokenization -------------------------------------------------------------------------

def _two_token_stop(tok, token_ids):
    """A stop string made of the last character of token k and all of token k + 1, whose first
    occurrence in the text is exactly there; returns (string, its index, k + 1)."""
    full = tok.decode(token_ids)
    for k in range(len(token_ids) - 1):
        a, b = tok.decode([token_ids[k]]), tok.decode([token_ids[k + 1]])
        if not a or not b or "\ufffd" in a + b:
            continue
        s = a[-1] + b
        boundary = len(tok.decode(token_ids[: k + 1]))
        if full.find(s) == boundary - 1 and s not in a and s not in b:
            return s, boundary - 1, k + 1
    raise AssertionError("no two-token stop string in the greedy output")


def test_stop_string_spanning_two_tokens(llm, tok):
    ids = tok(CAFE).input_ids
    plain = _greedy(llm, ids, 12)
    s, idx, last = _two_token_stop(tok, plain.token_ids)
    out = _greedy(llm, ids, 12, stop=[s])
    assert out.text == plain.text[:idx] and s not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == s
    assert out.token_ids == plain.token_ids[: last + 1]  # up to the token that completed it

    kept = _greedy(llm, ids, 12, stop=[s], include_stop_str_in_output=True)
    assert kept.text == plain.text[: idx + len(s)] and kept.text.endswith(s)
    assert kept.finish_reason == "stop" and kept.stop_reason == s
    _assert_all_blocks_free(llm)


def _force(seq):
    def proc(output_ids, logits):
        forced = torch.full_like(logits, float("-inf"))
        forced[seq[len(output_ids)]] = 0.0
        return forced
    return proc


def test_multibyte_stop_string_split_over_byte_tokens(llm, tok):
    char = "é"
    char_ids = tok(char, add_special_tokens=False).input_ids
    assert len(char_ids) >= 2 and all(tok.decode([t]) == "\ufffd" for t in char_ids)  # one byte per token
    head = tok("ab", add_special_tokens=False).input_ids
    seq = head + char_ids + head + head
    ids = tok(FOX).input_ids

    whole = _greedy(llm, ids, len(seq), logits_processors=[_force(seq)])
    assert whole.token_ids == seq
    assert whole.text == tok.decode(seq) == "ab" + char + "abab"

    out = _greedy(llm, ids, len(seq), stop=[char], logits_processors=[_force(seq)])
    assert out.text == "ab" and out.finish_reason == "stop" and out.stop_reason == char
    assert out.token_ids == head + char_ids
    kept = _greedy(llm, ids, len(seq), stop=[char], include_stop_str_in_output=True, logits_processors=[_force(seq)])
    assert kept.text == "ab" + char


@pytest.mark.parametrize("prompt", [PROMPT, FOX, CAFE, "Hello, my name is", "I like tea, cake"])
def test_text_equals_decode_of_tokens(llm, tok, prompt):
    out = _greedy(llm, prompt, 16)
    assert out.finish_reason == "length"
    assert out.text == tok.decode(out.token_ids)


def test_detokenize_false(llm, tok):
    ids = tok(FOX).input_ids
    plain = _greedy(llm, ids, 6)
    out = _greedy(llm, ids, 6, detokenize=False)
    assert out.text == "" and out.token_ids == plain.token_ids and plain.text


def test_skip_special_tokens(llm, tok):
    eos = tok.eos_token_id
    assert eos in tok.all_special_ids
    ids = tok(FOX).input_ids
    skipped = _greedy(llm, ids, 3, logit_bias={eos: 100.0})
    kept = _greedy(llm, ids, 3, logit_bias={eos: 100.0}, skip_special_tokens=False)
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    assert skipped.text == ""
    assert kept.text == tok.decode([eos] * 3, skip_special_tokens=False) and kept.text.count(tok.eos_token) == 3


def test_truncate_prompt_tokens(llm, tok):
    ids = tok(PROMPT).input_ids
    out = _gen(llm, PROMPT, temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=3)
    assert out.prompt_token_ids == ids[-3:]
    assert out.outputs[0].token_ids == _greedy(llm, ids[-3:], 5).token_ids


# ---- validation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n must"),
        (dict(n=3, best_of=2, temperature=1.0), "best_of"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_p=2.0), "min_p"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_invalid_params_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (lambda v: dict(logit_bias={v: 1.0}), "logit_bias"),
        (lambda v: dict(allowed_token_ids=[3, v]), "allowed_token_ids"),
        (lambda v: dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (lambda v: dict(stop_token_ids=[v + 5]), "stop_token_ids"),
        (lambda v: dict(stop=["x"], detokenize=False), "stop"),
    ],
    ids=["logit_bias", "allowed_big", "allowed_negative", "stop_token_ids", "stop_without_detokenize"],
)
def test_invalid_params_raise_at_generate_time(llm, tok, kwargs, field):
    vocab = len(tok)
    params = SamplingParams(**kwargs(vocab))
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match=field):
        llm.generate(["Hello", "Hello again"], [good, params], use_tqdm=False)
    _assert_all_blocks_free(llm)  # the good request, added first, was dropped too
    assert len(llm.generate("Hello", good, use_tqdm=False)[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "0.5", None, True])
def test_non_finite_or_non_numeric_floats_raise(field, value):
    """NaN passed every range check (a NaN temperature sampled <pad> tokens); a string raised TypeError."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={5: float("nan")}), "logit_bias"),  # was clamped to +100 by the server: forced the token
    (dict(logit_bias={5: float("inf")}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={5: "high"}), "logit_bias"),
    (dict(max_tokens="16"), "max_tokens"),
    (dict(max_tokens=2**64), "max_tokens"),
    (dict(seed=2**63), "seed"),
    (dict(min_tokens=None), "min_tokens"),
    (dict(logprobs=1.5), "logprobs"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop=["ok", "\ud800"]), "stop"),
    (dict(bad_words=["a\udfffb"]), "bad_words"),
    (dict(bad_words=[5]), "bad_words"),
])
def test_invalid_values_and_types_raise_value_error(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, match", [
    ("caf\udce9", "not valid Unicode"),  # a lone surrogate: the tokenizer raised TypeError
    ([5, -1], "out of vocabulary"),
    ([5, 2**63], "out of vocabulary"),  # was an OverflowError
    ({"prompt_token_ids": [2**64 + 1]}, "out of vocabulary"),
    ({"prompt_token_ids": [True, 5]}, "out of vocabulary"),
])
def test_invalid_prompts_raise_value_error(llm, prompt, match):
    good = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match=match):
        llm.generate(["Hello", prompt], good, use_tqdm=False)
    _assert_all_blocks_free(llm)
    assert len(llm.generate("Hello", good, use_tqdm=False)[0].outputs[0].token_ids) == 2


# ---- clone and generation config ---------------------------------------------------------------------------------

def test_clone_is_deep_except_logits_processors():
    def proc(ids, logits):
        return logits

    p = SamplingParams(stop=["a"], stop_token_ids=[3], logit_bias={4: 1.0}, allowed_token_ids=[1, 2],
                       bad_words=["x"], logits_processors=[proc])
    c = p.clone()
    assert c == p
    assert c.logits_processors is p.logits_processors and c.logits_processors[0] is proc
    for name in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "all_stop_token_ids"):
        assert getattr(c, name) is not getattr(p, name), name
    c.stop.append("b")
    c.logit_bias[5] = 2.0
    c.allowed_token_ids.append(9)
    assert p.stop == ["a"] and p.logit_bias == {4: 1.0} and p.allowed_token_ids == [1, 2]
    assert p.logits_processors == [proc]


def test_update_from_generation_config():
    p = SamplingParams(stop_token_ids=[5])
    p.update_from_generation_config({"eos_token_id": [1, 106]}, model_eos_token_id=1)
    assert p.stop_token_ids == [5, 106]
    assert 106 in p.all_stop_token_ids and 1 not in p.stop_token_ids
    p.update_from_generation_config({"eos_token_id": [1, 106]}, model_eos_token_id=1)
    assert p.stop_token_ids == [5, 106]  # no duplicates
    q = SamplingParams()
    q.update_from_generation_config({"eos_token_id": 7})
    assert q.stop_token_ids == [7]
    r = SamplingParams(ignore_eos=True)
    r.update_from_generation_config({"eos_token_id": [1, 106]}, model_eos_token_id=1)
    assert r.stop_token_ids == [] and 106 in r.all_stop_token_ids
    s = SamplingParams()
    s.update_from_generation_config({})
    assert s.stop_token_ids == []
