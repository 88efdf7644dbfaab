"""Hermes / Qwen2.5 / Qwen3 style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated for
parallel calls, with ordinary text allowed around them."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedOutput, ToolParser, ToolParserManager, join_content
from pagedllm.entrypoints.openai.tool_parsers.json_scan import scan_call_object, skip_ws

START, END = "<tool_call>", "</tool_call>"


@ToolParserManager.register("hermes")
class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = ParsedOutput()
        segments: list[str] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            segments.append(text[pos:] if start < 0 else text[pos:start])
            if start < 0:
                break
            i = skip_ws(text, start + len(START))
            obj = scan_call_object(text, i) if text.startswith("{", i) else None
            if obj is not None and obj.call is not None:
                out.calls.append(obj.call)
            if (obj is None and i == len(text)) or (obj is not None and obj.end is None and not obj.invalid):
                out.valid = not final  # the call is still arriving (or was cut off)
                segments.append("")
                break
            k = -1 if obj is None or obj.invalid or obj.call is None else skip_ws(text, obj.end)
            if k >= 0 and text.startswith(END, k):
                pos = k + len(END)
                continue
            if k >= 0 and END.startswith(text[k:]):
                # the closing tag is arriving; at the very end a missing one is forgiven (the model stopped)
                pos = len(text)
                segments.append("")
                break
            # malformed markup: not a call (non-streaming falls back to plain text); skip past its end tag
            out.valid = False
            close = text.find(END, i)
            if close < 0:
                segments.append("")
                break
            pos = close + len(END)
        out.content = join_content(segments, final, (START,))
        return out
