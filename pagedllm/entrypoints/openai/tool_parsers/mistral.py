"""Mistral: `[TOOL_CALLS]` then a JSON list `[{"name": ..., "arguments": {...}}, ...]`; text before the marker
is content. `[TOOL_CALLS]` is a special token, so the request must keep special tokens in the output text."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedOutput, ToolParser, ToolParserManager, join_content
from pagedllm.entrypoints.openai.tool_parsers.json_scan import Status, scan_call_sequence, skip_ws
from pagedllm.entrypoints.openai.tool_parsers.types import random_mistral_tool_call_id

MARKER = "[TOOL_CALLS]"


@ToolParserManager.register("mistral")
class MistralToolParser(ToolParser):
    def adjust_request(self, request: Any) -> Any:
        if getattr(request, "skip_special_tokens", None) is not None:
            request.skip_special_tokens = False  # otherwise the detokenizer drops [TOOL_CALLS]
        return request

    def make_tool_call_id(self) -> str:
        return random_mistral_tool_call_id()

    def parse(self, text: str, final: bool) -> ParsedOutput:
        mark = text.find(MARKER)
        if mark < 0:
            return ParsedOutput(content=join_content([text], final, (MARKER,)))
        out = ParsedOutput()
        i = skip_ws(text, mark + len(MARKER))
        after = ""
        if i == len(text):
            out.valid = not final
        elif text[i] in "[{":
            # a list, or (leniently) bare objects separated by commas
            bracket = text[i] == "["
            seq = scan_call_sequence(text, i + 1 if bracket else i, sep=",", close="]" if bracket else None)
            out.calls = seq.calls
            if seq.status is Status.DONE and seq.end is not None:
                after = text[seq.end:]
            elif seq.status is not Status.PENDING or (final and (seq.open_item or not seq.calls)):
                out.valid = False
        else:
            out.valid = False
        out.content = join_content([text[:mark], after], final, (MARKER,))
        return out
