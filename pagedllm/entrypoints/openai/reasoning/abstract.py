"""Base class and registry of reasoning parsers (splitting `<think>`-style reasoning from the answer).

A parser is written once, as `split(text, final)` -> (reasoning, content) of the whole text. Streaming is the
difference between the splits of the previous and the current text, which is correct as long as the split
with final=False is *stable*: each part of it is a prefix of the same part for any longer text. Parsers get
that by holding back a trailing prefix of a tag ("</th" may become "</think>"), so no tag text leaks into
either field however the deltas cut it. Being stateless, one instance may serve any number of streams.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pagedllm.entrypoints.openai.registry import Registry


def strip_partial(text: str, tag: str) -> str:
    """`text` minus a trailing proper prefix of `tag` (the tag may be arriving split across deltas)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


def _tail(old: str, new: str) -> str | None:
    return new[len(old):] if len(new) > len(old) and new.startswith(old) else None


class ReasoningParser(ABC):
    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of `text`; with final=False it must be stable (see module doc)."""

    @abstractmethod
    def is_reasoning_end(self, text: str) -> bool:
        """Whether the reasoning part of `text` is over: from then on output is answer (and tool calls)."""

    def extract_reasoning_content(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished output; empty parts are None, as in OpenAI bodies."""
        reasoning, content = self.split(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_content_streaming(
        self, previous_text: str, current_text: str, delta_text: str
    ) -> tuple[str | None, str | None]:
        """(reasoning delta, content delta) that `delta_text` adds; None where a part has nothing new.
        `delta_text` is implied by the other two and accepted only for vLLM's signature."""
        old_r, old_c = self.split(previous_text, final=False)
        new_r, new_c = self.split(current_text, final=False)
        return _tail(old_r, new_r), _tail(old_c, new_c)

    def finish_streaming(self, current_text: str) -> tuple[str | None, str | None]:
        """At end of stream: what was held back as a possible tag start; afterwards the streamed parts
        equal the non-streaming ones."""
        old_r, old_c = self.split(current_text, final=False)
        new_r, new_c = self.split(current_text, final=True)
        return _tail(old_r, new_r), _tail(old_c, new_c)


# Name -> parser class, filled by the `register` decorator as parser modules are imported.
ReasoningParserManager: Registry[type[ReasoningParser]] = Registry("reasoning parser")
