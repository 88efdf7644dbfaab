"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` (or "arguments"), optionally after
`<|python_tag|>`, several separated by `;`.

Without the tag a call is only recognised at the very start of the output: a JSON object in the middle of
prose is far more likely an example than a call. Until the first object shows a "name" it may still be plain
JSON content, so streaming holds it back rather than guess.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ParsedOutput,
    ToolParser,
    ToolParserManager,
    hold_back,
    join_content,
)
from pagedllm.entrypoints.openai.tool_parsers.json_scan import Status, scan_call_sequence, skip_ws

TAG = "<|python_tag|>"


@ToolParserManager.register("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        tag = text.find(TAG)
        if tag >= 0:
            before, start = text[:tag], tag + len(TAG)
        else:
            before, start = "", skip_ws(text, 0)
            if not text.startswith("{", start):
                # plain content; whitespace-only is held: a call may still follow it
                if final:
                    return ParsedOutput(content=text)
                return ParsedOutput(content=hold_back(text, (TAG,)))
        seq = scan_call_sequence(text, start, sep=";", close=None)
        if seq.status is Status.NOT_CALLS or (final and seq.status is Status.PENDING and not seq.calls):
            # the object was ordinary JSON, not a call
            if tag < 0:
                return ParsedOutput(content=text)
            return ParsedOutput(content=join_content([before, text[start:]], final))
        out = ParsedOutput(calls=seq.calls)
        after = text[seq.end:] if seq.status is Status.DONE and seq.end is not None else ""
        if seq.status is Status.INVALID or (final and seq.status is Status.PENDING and seq.open_item):
            out.valid = False
        out.content = join_content([before, after], final)
        return out
