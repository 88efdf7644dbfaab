"""Reasoning first, grammar after (`reasoning_parser`): the grammar applies only once the model
has closed its think block. A tiny Qwen3 with `<think>` and `</think>` as single tokens; a logits
processor closes the block at a chosen step, as a reasoning model would."""

from __future__ import annotations

import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.reasoner import Reasoner

CHOICES = ["yes", "no"]
THINK_STEPS = 3  # the free reasoning tokens before `</think>`


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_think):
    return LLM(tiny_qwen3_think, dtype="float32", kv_cache_memory=1 << 24, reasoning_parser="qwen3")


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def _close_think_at(end_id: int, step: int):
    """A processor that allows only `</think>` at output position `step`."""
    def proc(output_ids, logits):
        if len(output_ids) == step:
            keep = logits[end_id].clone()
            logits.fill_(float("-inf"))
            logits[end_id] = keep
        return logits
    return proc


def test_reasoner_reads_the_latest_think_tag(qwen3):
    r = Reasoner.from_tokenizer("qwen3", qwen3.get_tokenizer())
    s, e = r.start_token_id, r.end_token_id
    assert not r.is_reasoning_end([5, 6])  # no tag yet: a reasoning model starts by thinking
    assert not r.is_reasoning_end([5, s, 6])
    assert r.is_reasoning_end([5, s, 6, e, 7])
    assert not r.is_reasoning_end([s, e, 9, s, 10])  # a new think block after an old one


def test_unknown_parser_or_missing_tags_fail_at_start(tiny_llama):
    with pytest.raises(ValueError, match="'<think>' as one token"):
        LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24, reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        Reasoner.from_tokenizer("nope", None)


def test_reasoning_is_free_and_the_answer_follows_the_grammar(qwen3):
    tok = qwen3.get_tokenizer()
    end = tok.convert_tokens_to_ids("</think>")
    prompt = _ids(qwen3, "Is the sky blue? <think>")
    proc = _close_think_at(end, THINK_STEPS)
    free = qwen3.generate(prompt, SamplingParams(temperature=0, max_tokens=THINK_STEPS, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert not any(tok.decode(free).startswith(c) or c.startswith(tok.decode(free)) for c in CHOICES), \
        "the free tokens would not pass the grammar"
    params = SamplingParams(temperature=0, max_tokens=20, logits_processors=[proc],
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    out = qwen3.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:THINK_STEPS] == free  # the reasoning is not constrained
    assert out.token_ids[THINK_STEPS] == end
    assert out.text.split("</think>")[1] in CHOICES and out.finish_reason == "stop"


def test_a_prompt_that_closed_the_think_block_is_constrained_at_once(qwen3):
    """Qwen3's template with thinking off ends the prompt with an empty think block."""
    prompt = _ids(qwen3, "Is the sky blue? <think>\n\n</think>\n\n")
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    out = qwen3.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop"


def test_drafts_stop_at_the_end_of_the_reasoning(qwen3):
    """A speculative draft that runs past `</think>` is cut after it: the rows after it had no mask."""
    manager = qwen3.llm_engine.engine_core.structured_output_manager
    end = qwen3.get_tokenizer().convert_tokens_to_ids("</think>")
    so = manager.submit(StructuredOutputsParams(choice=CHOICES), _ids(qwen3, "Hi <think>"))
    deadline = time.monotonic() + 60
    while not so.ready() and time.monotonic() < deadline:  # compiled in a child process
        time.sleep(0.01)
    assert so.ready() and so.error is None and not so.reasoning_ended
    assert manager.valid_prefix(so, [7, 8, end, 9, 10]) == [7, 8, end]
    assert manager.grammar_bitmask([("r", so, [])]) is None  # still reasoning: no row to mask
    for token in (7, end):
        assert so.accept_token(token)
    assert so.reasoning_ended and manager.grammar_bitmask([("r", so, [])]) is not None
