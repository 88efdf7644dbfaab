"""Base class and registry of tool-call parsers.

Every parser is written once, as `parse(text, final)`: a whole-text parse into content and calls. Streaming
re-parses the text so far and sends only what is new, so the two modes cannot drift apart. For that,
`parse(text, final=False)` must be *stable*: what it reports for a text is a prefix of what it will report
for any longer text (content only grows, a call's name never changes, its arguments only grow). Parsers get
there by holding back anything still ambiguous: a half-arrived marker, whitespace that may end up next to
call markup, an opening `{` that may or may not be a call.
"""

from __future__ import annotations

import builtins
import json
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.registry import Registry
from pagedllm.entrypoints.openai.tool_parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    random_tool_call_id,
)

logger = logging.getLogger(__name__)


@dataclass
class ParsedCall:
    name: str | None
    arguments: str  # the JSON arguments text known so far (complete once `complete`)
    complete: bool = False
    broken: bool = False  # its markup turned out malformed: nothing more is streamed for it


@dataclass
class ParsedOutput:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    valid: bool = True  # False: some call markup is malformed, so the whole output is plain content


def _partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest proper prefix of a marker that `text` ends with (0 if none)."""
    cut = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), cut, -1):
            if text.endswith(m[:k]):
                cut = k
                break
    return cut


def hold_back(text: str, markers: tuple[str, ...] = ()) -> str:
    """`text` minus a trailing partial marker (it may be the start of call markup) and trailing whitespace
    (it may end up next to call markup, where it is not content)."""
    cut = _partial_marker_len(text, markers)
    return (text[:-cut] if cut else text).rstrip()


def join_content(segments: list[str], final: bool, markers: tuple[str, ...] = ()) -> str:
    """Content from the text outside call markup: `segments[0]` precedes the first markup (if any), the
    rest follow markup. Whitespace that only separates content from markup at either end is dropped
    (so "Sure.\n<call>" gives "Sure."), whitespace between content pieces is kept. While streaming, the
    last segment may end in a marker that is still arriving: that part is held back."""
    calls_seen = len(segments) > 1
    lead_markup = calls_seen and not segments[0].strip()
    if not final:
        cut = _partial_marker_len(segments[-1], markers)
        segments = segments[:-1] + [segments[-1][:len(segments[-1]) - cut]]
    text = "".join(segments)
    if lead_markup:
        text = text.lstrip()
    return text.rstrip() if calls_seen or not final else text


def is_json_object(s: str) -> bool:
    try:
        return isinstance(json.loads(s), dict)
    except ValueError:
        return False


class ToolParser(ABC):
    """One instance per generated choice: streaming state lives on the instance."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._content = ""  # content streamed so far
        self._streamed: list[ToolCall] = []  # calls as streamed so far, by wire index
        self._index_of: dict[int, int] = {}  # position in parse().calls -> wire index

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and calls in `text`; with final=False the result must be stable (see module doc)."""

    def adjust_request(self, request: Any) -> Any:
        """Hook for parsers whose markers are special tokens that detokenizing would otherwise drop."""
        return request

    def make_tool_call_id(self) -> str:
        return random_tool_call_id()

    def extract_tool_calls(self, model_output: str, tools: list | None = None) -> ExtractedToolCalls:
        """Calls in a finished output. Anything malformed makes it plain content: a reply that is shown
        as text is recoverable for the client, a half-understood call is not. Never raises."""
        plain = ExtractedToolCalls(tools_called=False, content=model_output)
        try:
            parsed = self.parse(model_output, final=True)
        except Exception:  # a parser bug must not fail the request
            logger.exception("%s failed on a model output", type(self).__name__)
            return plain
        if not parsed.valid or not parsed.calls:
            return plain
        calls = []
        for c in parsed.calls:
            if c.name is None or not c.complete or c.broken or not is_json_object(c.arguments):
                return plain
            calls.append(ToolCall(id=self.make_tool_call_id(), function=FunctionCall(name=c.name,
                                                                                      arguments=c.arguments)))
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=parsed.content or None)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str
    ) -> DeltaMessage | None:
        """What `delta_text` adds: content and/or tool-call deltas, or None when nothing can be sent yet.

        A call is announced once its name is known (index, id, type, name, and the arguments so far, maybe
        ""); later deltas carry only more argument text. Markup is never sent as content. Only
        `current_text` is used (state is kept here); the other two are accepted for vLLM's signature."""
        return self._stream(current_text, final=False)

    def finish_streaming(self, current_text: str) -> DeltaMessage | None:
        """Flush at end of stream what was held back in case more text changed its meaning (trailing
        whitespace, a prefix of a marker); afterwards the streamed content equals the non-streaming one."""
        return self._stream(current_text, final=True)

    @property
    def streamed_tool_calls(self) -> builtins.list[ToolCall]:
        """Calls announced so far with the arguments sent so far, e.g. to pick finish_reason "tool_calls"."""
        return [c.model_copy(deep=True) for c in self._streamed]

    def _stream(self, text: str, final: bool) -> DeltaMessage | None:
        try:
            parsed = self.parse(text, final)
        except Exception:
            logger.exception("%s failed on a streamed output", type(self).__name__)
            return None
        content = None
        if len(parsed.content) > len(self._content) and parsed.content.startswith(self._content):
            content = parsed.content[len(self._content):]
            self._content = parsed.content
        deltas = []
        for pos, call in enumerate(parsed.calls):
            idx = self._index_of.get(pos)
            if idx is None:
                if call.name is None or call.broken:
                    continue
                idx = self._index_of[pos] = len(self._streamed)
                tc = ToolCall(id=self.make_tool_call_id(), function=FunctionCall(name=call.name,
                                                                                 arguments=call.arguments))
                self._streamed.append(tc)
                deltas.append(DeltaToolCall(index=idx, id=tc.id, type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                continue
            sent = self._streamed[idx].function
            if call.broken or len(call.arguments) <= len(sent.arguments) or not call.arguments.startswith(
                sent.arguments
            ):
                continue
            piece = call.arguments[len(sent.arguments):]
            sent.arguments = call.arguments
            deltas.append(DeltaToolCall(index=idx, function=DeltaFunctionCall(arguments=piece)))
        if content is None and not deltas:
            return None
        return DeltaMessage(content=content, tool_calls=deltas)


# Name -> parser class, filled by the `register` decorator as parser modules are imported.
ToolParserManager: Registry[type[ToolParser]] = Registry("tool parser")
