"""Qwen3: an optional `<think>...</think>` block at the start of the output.

With `enable_thinking=False` the template puts an empty think block into the *prompt*, so the output has
none and is all content; likewise any output that does not open with `<think>`. An opened block that never
closes (cut off by max_tokens) is all reasoning in both modes — vLLM's non-streaming path would return it
as content with the raw tag, which would disagree with what it streamed.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.abstract import ReasoningParser, ReasoningParserManager, strip_partial

START, END = "<think>", "</think>"


@ReasoningParserManager.register("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    def split(self, text: str, final: bool) -> tuple[str, str]:
        lead = len(text) - len(text.lstrip())
        if text.startswith(START, lead):
            body = lead + len(START)
            end = text.find(END, body)
            if end < 0:
                return (text[body:] if final else strip_partial(text[body:], END)), ""
            return text[body:end], text[end + len(END):]
        if not final and START.startswith(text[lead:]):
            return "", ""  # nothing yet but whitespace, or the opening tag is arriving
        return "", text

    def is_reasoning_end(self, text: str) -> bool:
        lead = len(text) - len(text.lstrip())
        if text.startswith(START, lead):
            return END in text
        return not START.startswith(text[lead:])
