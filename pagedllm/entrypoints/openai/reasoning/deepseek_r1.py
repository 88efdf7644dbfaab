"""DeepSeek-R1 (and QwQ, Qwen3 "thinking-2507"): reasoning first, closed by `</think>`.

Their chat templates end the prompt with `<think>\\n`, so the output usually lacks the opening tag; one at the
very start is dropped. Everything before `</think>` is reasoning; with no `</think>` at all (still thinking,
or cut off by max_tokens) the whole output is reasoning and content is None — vLLM's behaviour for this
parser in both modes.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.abstract import ReasoningParser, ReasoningParserManager, strip_partial

START, END = "<think>", "</think>"


@ReasoningParserManager.register("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    def split(self, text: str, final: bool) -> tuple[str, str]:
        lead = len(text) - len(text.lstrip())
        if text.startswith(START, lead):
            body = lead + len(START)
        elif not final and START.startswith(text[lead:]):
            return "", ""  # the opening tag may be arriving
        else:
            body = 0
        end = text.find(END, body)
        if end < 0:
            return (text[body:] if final else strip_partial(text[body:], END)), ""
        return text[body:end], text[end + len(END):]

    def is_reasoning_end(self, text: str) -> bool:
        return END in text
