"""Reasoning parsers on canned outputs, whole and streamed (per char, in random chunks, per token of a real
tokenizer): the streamed parts must add up to the non-streaming ones exactly, so no tag text can leak into
either (deltas only ever append)."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.reasoning import ReasoningParser, ReasoningParserManager
from tests.utils import chunkings as _chunkings

# parser -> [(model output, expected reasoning_content, expected content)]
CASES: dict[str, list[tuple[str, str | None, str | None]]] = {
    "deepseek_r1": [
        ("The user asks 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**.", "The user asks 2+2.\nThat is 4.\n",
         "\n\nThe answer is **4**."),
        ("<think>\nWith the tag this time.</think>Answer: café 🎉", "\nWith the tag this time.", "Answer: café 🎉"),
        ("Still thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
        ("Thought through.</think>", "Thought through.", None),
        ("</think>Only an answer", None, "Only an answer"),
        ("Mentions <think> and </th but ends </think> real", "Mentions <think> and </th but ends ", " real"),
        ("", None, None),
    ],
    "qwen3": [
        ("<think>\nLet me think about 2+2.\n</think>\n\nIt is 4.", "\nLet me think about 2+2.\n", "\n\nIt is 4."),
        ("It is 4. (enable_thinking=False: no think block)", None, "It is 4. (enable_thinking=False: no think block)"),
        ("<think>\n\n</think>\n\nEmpty thoughts.", "\n\n", "\n\nEmpty thoughts."),
        ("<think>cut off by max_tokens", "cut off by max_tokens", None),
        ("\n<think>x</think>y", "x", "y"),
        ("An answer that mentions <think> mid-way", None, "An answer that mentions <think> mid-way"),
        ("<thinking is not the tag", None, "<thinking is not the tag"),
        ("", None, None),
    ],
}


def chunkings(text: str, tok) -> dict[str, list[str]]:
    return _chunkings(text, tok, seeds=4, max_chunk=7)


def stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content, prev = "", "", ""
    for piece in pieces:
        cur = prev + piece
        r, c = parser.extract_reasoning_content_streaming(prev, cur, piece)
        assert r != "" and c != ""  # nothing to say is None
        reasoning, content, prev = reasoning + (r or ""), content + (c or ""), cur
    r, c = parser.finish_streaming(prev)
    return reasoning + (r or ""), content + (c or "")


@pytest.mark.parametrize("name,case", [(n, i) for n, cases in CASES.items() for i in range(len(cases))])
def test_split_whole_and_streamed(name, case, fake_tokenizer):
    output, want_reasoning, want_content = CASES[name][case]
    parser = ReasoningParserManager.get(name)(fake_tokenizer)
    assert parser.extract_reasoning_content(output) == (want_reasoning, want_content)
    for how, pieces in chunkings(output, fake_tokenizer).items():
        assert stream(parser, pieces) == (want_reasoning or "", want_content or ""), how


@pytest.mark.parametrize("name", sorted(CASES))
def test_end_tag_split_across_deltas(name):
    parser = ReasoningParserManager.get(name)()
    prefix = "<think>" if name == "qwen3" else ""
    steps = [(prefix + "abc</th", ("abc", None)), (prefix + "abc</think>", (None, None)),
             (prefix + "abc</think>\nde", (None, "\nde"))]
    prev = ""
    for cur, want in steps:
        assert parser.extract_reasoning_content_streaming(prev, cur, cur[len(prev):]) == want
        prev = cur
    # a held-back "</th" that turns out not to be the tag is released as reasoning
    assert parser.extract_reasoning_content_streaming(prefix + "x</th", prefix + "x</thus", "us") == ("</thus", None)


def test_start_tag_split_across_deltas():
    for name in ("qwen3", "deepseek_r1"):
        parser = ReasoningParserManager.get(name)()
        assert parser.extract_reasoning_content_streaming("", "<th", "<th") == (None, None)
        assert parser.extract_reasoning_content_streaming("<th", "<think>", "ink>") == (None, None)
        assert parser.extract_reasoning_content_streaming("<think>", "<think>hm", "hm") == ("hm", None)
    qwen = ReasoningParserManager.get("qwen3")()
    assert qwen.extract_reasoning_content_streaming("<th", "<thx", "x") == (None, "<thx")  # not the tag after all


def test_is_reasoning_end():
    r1, qwen = ReasoningParserManager.get("deepseek_r1")(), ReasoningParserManager.get("qwen3")()
    assert not r1.is_reasoning_end("thinking") and r1.is_reasoning_end("done</think>")
    assert not qwen.is_reasoning_end("<think>hm") and qwen.is_reasoning_end("<think>hm</think>ok")
    assert qwen.is_reasoning_end("plain answer") and not qwen.is_reasoning_end("<thi")


def test_registry():
    assert {"deepseek_r1", "qwen3"} <= set(ReasoningParserManager.list())
    assert issubclass(ReasoningParserManager.get("qwen3"), ReasoningParser)
    with pytest.raises(ValueError, match="deepseek_r1"):
        ReasoningParserManager.get("nope")
