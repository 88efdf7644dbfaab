"""Structured outputs offline, on the tiny random-weight models: their outputs are valid only
if the grammar bitmask is applied to the right rows at every step. JSON schemas, regexes,
choices, EBNF grammars and json_object, with n=3 sampling, mixed batches, stop strings,
logprobs, chunked prefill and preemption; invalid specs fail at generate() before scheduling."""

from __future__ import annotations

import json
import math
import re
import threading

import jsonschema
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

KV = 1 << 24
PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. Paged attention stores keys"]

# Every branch of these specs is bounded, so a random model can only finish: enums, booleans,
# integers with minimum/maximum, strings with a pattern, arrays with maxItems, no extra keys.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": -20, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "pt": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "null"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "ok", "color", "n", "tags", "pt"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{2,4}(\.[a-f]{1,3})?"
CHOICES = ["yes", "no", "perhaps not", "café ✓"]
# A small arithmetic list; the repetitions are bounded so the random model must close it.
GRAMMAR = r"""
# a list of up to four items: numbers or parenthesised products
root ::= "[" item ("," item){0,3} "]"
item ::= num | "(" num ("*" num)? ")"
num ::= [1-9] [0-9]{0,2}
"""
_NUM = r"[1-9][0-9]{0,2}"
_ITEM = rf"(?:{_NUM}|\({_NUM}(?:\*{_NUM})?\))"
GRAMMAR_RE = rf"\[{_ITEM}(?:,{_ITEM}){{0,3}}\]"

SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_str": StructuredOutputsParams(json=json.dumps(SCHEMA)),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
    "json_object": StructuredOutputsParams(json_object=True),
}


def assert_valid(kind: str, text: str) -> None:
    if kind in ("json", "json_str"):
        obj = json.loads(text)
        jsonschema.validate(obj, SCHEMA)
        assert list(obj) == list(SCHEMA["properties"]), "properties come in the schema's order"
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "grammar":
        assert re.fullmatch(GRAMMAR_RE, text), text
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    else:
        raise AssertionError(kind)


def assert_all_valid(kind: str, outs, n: int) -> None:
    for out in outs:
        assert len(out.outputs) == n
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, c.text, c.finish_reason, len(c.token_ids))
            assert_valid(kind, c.text)


def params(kind: str, tok, **kwargs) -> SamplingParams:
    """SamplingParams for SPECS[kind]. JSON allows any amount of whitespace between tokens, and any
    JSON object is unbounded besides (strings, nesting): a random model walks on for hundreds of
    tokens. A logit bias against whitespace (and, for json_object, towards '"', '}' and EOS) makes
    it finish sooner; it cannot make it valid: the tokens the mask removes stay at -inf."""
    kwargs.setdefault("max_tokens", 200)
    if kind in ("json", "json_str", "json_object"):
        bias = {i: -4.0 for i in _whitespace_ids(tok)}
        if kind == "json_object":
            bias.update({i: 5.0 for i in [tok.convert_tokens_to_ids(t) for t in ('"', "}")] + [tok.eos_token_id]})
        kwargs["logit_bias"] = bias
    return SamplingParams(structured_outputs=SPECS[kind], **kwargs)


def _whitespace_ids(tok) -> list[int]:
    special = set(tok.all_special_ids)
    return [i for i in range(len(tok)) if i not in special and not tok.decode([i]).strip(" \t\r\n")]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread is fastest, and immune to a busy second core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return LLM(tiny_llama, dtype="float32", kv_cache_memory=KV)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def any_llm(request, llama, llm):
    return llama if request.param == "llama" else llm


def assert_idle(llm: LLM) -> None:
    stats = llm.llm_engine.get_stats()
    assert not llm.llm_engine.has_unfinished_requests()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


# ---- every kind, sampled --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(SPECS))
def test_sampled_outputs_are_valid(any_llm, kind):
    tok = any_llm.get_tokenizer()
    outs = any_llm.generate(PROMPTS, params(kind, tok, n=3, temperature=1.0, seed=1234), use_tqdm=False)
    assert_all_valid(kind, outs, 3)
    # Sampling, not a constant: the six samples are not all the same (the choice has four options).
    assert len({c.text for o in outs for c in o.outputs}) > 1
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
            assert re.fullmatch(rf"\[{_ITEM}", c.text), c.text
        else:  # a one-item list, ended by the grammar
            assert c.stop_reason is None and re.fullmatch(rf"\[{_ITEM}\]", c.text), c
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


# ---- invalid specs --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": 5}), "properties must be an object"),
    (dict(json={"type": "foo"}), 'Unsupported type "foo"'),
    (dict(json={"type": "string", "pattern": "(ab"}), "parenthesis is not closed"),
    (dict(json='{"type": "object", '), "not valid JSON"),
    (dict(json="[1, 2]"), "Schema should be an object or bool"),
    (dict(regex="(ab"), "parenthesis is not closed"),
    (dict(regex="a{3,1}"), "Lower bound is larger than upper bound"),
    (dict(grammar='start ::= "a"'), 'root rule with name "root" is not found'),
    (dict(grammar='root ::= "a'), "Expect \" in string literal"),
    (dict(grammar="root ::= foo"), 'Rule "foo" is not defined'),
])
def test_invalid_spec_fails_at_generate(llama, spec, message):
    """The compiler's message, at generate(), before anything is scheduled: the valid request of
    the same call is withdrawn too, and the engine goes on."""
    so = StructuredOutputsParams(**spec)
    kind = next(iter(spec))
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError, match=f"structured_outputs.{kind}.*{re.escape(message)}"):
        llama.generate(PROMPTS, [good, SamplingParams(structured_outputs=so)], use_tqdm=False)
    assert_idle(llama)
    assert llama.llm_engine.get_stats()["num_preemptions"] == 0
    assert len(llama.generate(PROMPTS[0], good, use_tqdm=False)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("spec, message", [
    (dict(choice=[]), "non-empty list of strings"),
    (dict(choice=["a", 1]), "non-empty list of strings"),
    (dict(), "exactly one of"),
    (dict(json_object=False), "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(json={"type": "object"}, grammar='root ::= "a"'), "exactly one of"),
])
def test_malformed_params(llama, spec, message):
    with pytest.raises(ValueError, match=message):
        llama.generate(PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)),
                       use_tqdm=False)
    assert_idle(llama)


def test_compile_failure_in_engine_aborts_only_that_request(llama, monkeypatch):
    """A grammar that passes the front end's check but fails to compile in the engine core ends
    its own request (abort, with the error) and nothing else."""
    manager = llama.llm_engine.engine_core.structured_output_manager

    def broken(so):
        raise ValueError("invalid structured_outputs.regex: boom")

    monkeypatch.setattr(manager, "_compile", broken)
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llama.generate(PROMPTS, [good, SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))],
                          use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 8 and outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "abort" and outs[1].outputs[0].token_ids == []
    assert "boom" in str(outs[1].outputs[0].stop_reason)
    assert_idle(llama)


def test_compiling_grammar_does_not_block_others(llama, monkeypatch):
    """While a grammar compiles (WAITING_FOR_FSM) the requests behind it run: here the compile
    cannot finish until the free request has produced five tokens."""
    manager = llama.llm_engine.engine_core.structured_output_manager
    compile_ = manager._compile
    released = threading.Event()

    def slow_compile(so):
        if not released.wait(timeout=30):
            raise RuntimeError("the free request never ran while the grammar compiled")
        return compile_(so)

    def release_after_five(output_ids, logits):
        if len(output_ids) >= 5:
            released.set()
        return logits

    monkeypatch.setattr(manager, "_compile", slow_compile)
    tok = llama.get_tokenizer()
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    watched = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logits_processors=[release_after_five])
    outs = llama.generate(PROMPTS, [params("regex", tok, n=3, temperature=1.0, seed=2), watched], use_tqdm=False)
    assert_all_valid("regex", outs[:1], 3)
    assert outs[1].outputs[0].token_ids == llama.generate(PROMPTS[1], free, use_tqdm=False)[0].outputs[0].token_ids
    assert_idle(llama)


def test_same_spec_compiles_once(llama):
    """xgrammar's compiler cache: a spec seen before adds nothing; a new one does."""
    manager = llama.llm_engine.engine_core.structured_output_manager
    so = StructuredOutputsParams(regex=r"(ab|cd){1,3}-[0-9]{1,2}\.")
    llama.generate(PROMPTS[0], SamplingParams(structured_outputs=so, temperature=0), use_tqdm=False)
    size = manager._compiler.compiler.get_cache_size_bytes()
    assert size > 0
    same = StructuredOutputsParams(regex=r"(ab|cd){1,3}-[0-9]{1,2}\.")
    outs = llama.generate(PROMPTS, SamplingParams(structured_outputs=same, n=3, temperature=1.0, seed=9),
                          use_tqdm=False)
    assert all(re.fullmatch(r"(ab|cd){1,3}-[0-9]{1,2}\.", c.text) for o in outs for c in o.outputs)
    assert manager._compiler.compiler.get_cache_size_bytes() == size
    other = StructuredOutputsParams(regex=r"(ab|cd){1,3}-[0-9]{1,2}!")
    llama.generate(PROMPTS[0], SamplingParams(structured_outputs=other, temperature=0), use_tqdm=False)
    assert manager._compiler.compiler.get_cache_size_bytes() > size


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
