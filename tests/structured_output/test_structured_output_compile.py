"""Structured-output specs that are wrong fail at generate() with the compiler's message, before
anything is scheduled; a compile that fails in the engine core aborts only its request; compiling
does not hold up other requests, and a spec seen before is not compiled again."""

from __future__ import annotations

import re
import threading

import pytest

from pagedllm import SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.structured_output.conftest import PROMPTS, assert_all_valid, params
from tests.utils import assert_idle

pytestmark = pytest.mark.usefixtures("one_thread")


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

    def broken(so, prompt_token_ids):
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

    def slow_compile(so, prompt_token_ids):
        if not released.wait(timeout=30):
            raise RuntimeError("the free request never ran while the grammar compiled")
        return compile_(so, prompt_token_ids)

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
    """The compiled-grammar cache: a spec seen before adds nothing; a new one does."""
    manager = llama.llm_engine.engine_core.structured_output_manager
    so = StructuredOutputsParams(regex=r"(ab|cd){1,3}-[0-9]{1,2}\.")
    llama.generate(PROMPTS[0], SamplingParams(structured_outputs=so, temperature=0), use_tqdm=False)
    size = manager._compiler.pool.cache_size_bytes()
    assert size > 0
    same = StructuredOutputsParams(regex=r"(ab|cd){1,3}-[0-9]{1,2}\.")
    outs = llama.generate(PROMPTS, SamplingParams(structured_outputs=same, n=3, temperature=1.0, seed=9),
                          use_tqdm=False)
    assert all(re.fullmatch(r"(ab|cd){1,3}-[0-9]{1,2}\.", c.text) for o in outs for c in o.outputs)
    assert manager._compiler.pool.cache_size_bytes() == size
    other = StructuredOutputsParams(regex=r"(ab|cd){1,3}-[0-9]{1,2}!")
    llama.generate(PROMPTS[0], SamplingParams(structured_outputs=other, temperature=0), use_tqdm=False)
    assert manager._compiler.pool.cache_size_bytes() > size
