"""Structured outputs offline, on the tiny random-weight models: their outputs are valid only
if the grammar bitmask is applied to the right rows at every step. JSON schemas, regexes,
choices, EBNF grammars and json_object, with n=3 sampling, mixed batches, stop strings,
logprobs, chunked prefill and preemption. Invalid specs and compiling: test_structured_output_compile.py."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.structured_output.conftest import (
    ITEM_RE,
    KV,
    PROMPTS,
    REGEX,
    SCHEMA,
    SPECS,
    assert_all_valid,
    assert_valid,
    params,
)
from tests.utils import assert_idle

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True, scope="module")
def one_grammar_compiler():
    """One grammar compiler process for each engine this module starts, not the default two (each
    imports xgrammar, seconds of CPU): here grammars are few and small, compiled once each.
    test_grammar_compile_jam.py tests the default two."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_GRAMMAR_COMPILE_WORKERS", "1")
        yield


# ---- every kind, sampled --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(SPECS))
def test_sampled_outputs_are_valid(any_llm, kind):
    tok = any_llm.get_tokenizer()
    texts = set()
    # Sampling, not a constant: the samples are not all the same (the choice has four options). Six
    # draws of a peaked choice can agree under one seed (the device's random stream decides which),
    # so up to three seeds.
    for seed in (1234, 1235, 1236):
        outs = any_llm.generate(PROMPTS, params(kind, tok, n=3, temperature=1.0, seed=seed), use_tqdm=False)
        assert_all_valid(kind, outs, 3)
        texts |= {c.text for o in outs for c in o.outputs}
        if len(texts) > 1:
            break
    assert len(texts) > 1
    assert_idle(any_llm)


def test_greedy_outputs_are_valid_and_deterministic(llama):
    tok = llama.get_tokenizer()
    for kind in SPECS:
        p = params(kind, tok, temperature=0)
        first = llama.generate(PROMPTS, p, use_tqdm=False)
        assert_all_valid(kind, first, 1)
        again = llama.generate(PROMPTS, p, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


def test_json_without_free_whitespace(any_llm):
    """disable_any_whitespace: compact JSON (separators "," and ":"), so no bias is needed to finish."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = any_llm.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, seed=10, max_tokens=200,
                                                    structured_outputs=so), use_tqdm=False)
    assert_all_valid("json", outs, 3)
    assert all(c.text == json.dumps(json.loads(c.text), separators=(",", ":")) for o in outs for c in o.outputs)


# ---- with the rest of the engine ------------------------------------------------------------------------------

def test_mixed_batch(any_llm):
    """Structured and free requests in one batch: the free ones are untouched by the masks
    (equal to running alone), the structured ones equal their own solo runs."""
    tok = any_llm.get_tokenizer()
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batch = [
        (PROMPTS[0], free),
        (PROMPTS[1], params("json", tok, temperature=0)),
        (PROMPTS[1], free),
        (PROMPTS[0], params("grammar", tok, temperature=0)),
        ("Unicode: caf", free),
        (PROMPTS[0], params("choice", tok, n=3, temperature=1.0, seed=7)),
        (PROMPTS[1], params("regex", tok, temperature=0)),
    ]
    alone = [any_llm.generate(p, sp, use_tqdm=False)[0] for p, sp in batch]
    mixed = any_llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    for (prompt, _), a, m in zip(batch, alone, mixed):
        assert [c.token_ids for c in m.outputs] == [c.token_ids for c in a.outputs], prompt
    for i, kind in ((1, "json"), (3, "grammar"), (5, "choice"), (6, "regex")):
        assert_all_valid(kind, [mixed[i]], batch[i][1].n)
    # The free requests really are free: they produce what the grammars forbid.
    for i in (0, 2, 4):
        assert len(mixed[i].outputs[0].token_ids) == 24
        assert not re.fullmatch(REGEX, mixed[i].outputs[0].text)
    assert_idle(any_llm)


def test_stop_strings(llama):
    """A stop string the grammar must produce ends it there; one it may produce truncates it."""
    tok = llama.get_tokenizer()
    outs = llama.generate(PROMPTS, params("grammar", tok, n=3, temperature=1.0, seed=3, stop="]",
                                          include_stop_str_in_output=True), use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop" and c.stop_reason == "]", c
        assert_valid("grammar", c.text)

    outs = llama.generate(PROMPTS * 3, params("grammar", tok, n=3, temperature=1.0, seed=4, stop=","),
                          use_tqdm=False)
    stopped = 0
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop"
        if c.stop_reason == ",":  # cut before the stop string: the first item of a valid list
            stopped += 1
            assert re.fullmatch(rf"\[{ITEM_RE}", c.text), c.text
        else:  # a one-item list, ended by the grammar
            assert c.stop_reason is None and re.fullmatch(rf"\[{ITEM_RE}\]", c.text), c
    assert stopped
    assert_idle(llama)


def test_logprobs(any_llm):
    tok = any_llm.get_tokenizer()
    for kind in ("json", "regex", "choice"):
        outs = any_llm.generate(PROMPTS, params(kind, tok, n=3, temperature=1.0, seed=5, logprobs=2),
                                use_tqdm=False)
        assert_all_valid(kind, outs, 3)
        for c in (c for o in outs for c in o.outputs):
            assert len(c.logprobs) == len(c.token_ids)
            for token, entry in zip(c.token_ids, c.logprobs):
                assert token in entry and 2 <= len(entry) <= 3
                assert all(math.isfinite(lp.logprob) and lp.logprob <= 0 for lp in entry.values())
            assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_chunked_prefill(tiny_llama, llama):
    """Prompts prefilled 4 tokens a step: the mask applies only where a token is sampled, and
    greedy outputs equal the unchunked ones."""
    chunked = LLM(tiny_llama, dtype="float32", kv_cache_memory=KV, max_num_batched_tokens=4)
    tok = chunked.get_tokenizer()
    kinds = ["json", "regex", "choice", "grammar", "json_object"]
    for kind in kinds:
        outs = chunked.generate(PROMPTS, params(kind, tok, n=3, temperature=1.0, seed=6), use_tqdm=False)
        assert_all_valid(kind, outs, 3)
    ps = [params(kind, tok, temperature=0) for kind in kinds]
    prompts = [PROMPTS[i % 2] for i in range(len(kinds))]
    got = chunked.generate(prompts, ps, use_tqdm=False)
    want = llama.generate(prompts, ps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert_idle(chunked)


def test_preemption(tiny_llama, llama):
    """8 blocks of 16 for 6 requests: they preempt each other and recompute; the matchers keep
    their state across it, so the outputs stay valid and equal the unpreempted ones."""
    small = LLM(tiny_llama, dtype="float32", num_gpu_blocks_override=8, block_size=16, max_model_len=128)
    tok = small.get_tokenizer()
    kinds = ["json", "regex", "grammar", "choice", "json", "grammar"]
    prompts = [PROMPTS[1] + f" {i}" for i in range(len(kinds))]
    ps = [params(kind, tok, temperature=0, max_tokens=100) for kind in kinds]
    want = llama.generate(prompts, ps, use_tqdm=False)
    got = small.generate(prompts, ps, use_tqdm=False)
    assert small.llm_engine.get_stats()["num_preemptions"] >= 1
    for kind, out in zip(kinds, got):
        assert_all_valid(kind, [out], 1)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]

    before = small.llm_engine.get_stats()["num_preemptions"]
    ps = [params(kind, tok, n=2, temperature=1.0, seed=8, max_tokens=100) for kind in kinds]
    got = small.generate(prompts, ps, use_tqdm=False)
    assert small.llm_engine.get_stats()["num_preemptions"] > before
    for kind, out in zip(kinds, got):
        assert_all_valid(kind, [out], 2)
    assert_idle(small)


# ---- the real default model -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model():
    """Gemma 3 270M (a base model) with its 262k vocabulary: JSON and choices come out valid,
    and the mask does not garble what the model means."""
    llm = LLM(dtype="bfloat16", max_model_len=1024, kv_cache_memory=256 << 20)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "London", "Tokyo"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    prompts = ["Here is a JSON object describing a person who lives in Paris:\n",
               "Alice is 30 years old. As JSON:\n", "The user record: "]
    so = StructuredOutputsParams(json=schema)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, structured_outputs=so), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        obj = json.loads(c.text)
        jsonschema.validate(obj, schema)
        assert list(obj) == ["name", "age", "city"]

    choices = [["Paris", "London", "Berlin"], ["Jupiter", "Mars", "Venus"], ["3", "4", "5"]]
    prompts = ["The capital of France is", "The largest planet in the solar system is", "2 + 2 ="]
    ps = [SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=16,
                         structured_outputs=StructuredOutputsParams(choice=c)) for c in choices]
    for out, cs in zip(llm.generate(prompts, ps, use_tqdm=False), choices):
        assert all(c.text in cs and c.finish_reason == "stop" for c in out.outputs), out.outputs
    greedy = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices[0]))
    assert llm.generate(prompts[0], greedy, use_tqdm=False)[0].outputs[0].text == "Paris"
