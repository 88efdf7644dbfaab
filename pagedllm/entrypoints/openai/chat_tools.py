"""Tool calling and reasoning for chat completions.

`tool_choice="required"` and a named function are enforced with structured outputs: a JSON
schema built from the tools (for `required`, an array of `{"name", "parameters"}` objects:
one with `parallel_tool_calls=false`, else up to `--max-parallel-tool-calls`, 8 by default),
so even a model never trained for tools produces valid calls, and stops. `tools` without a
`tool_choice` means "auto", as in OpenAI's API. "auto" relies on the model's own markup,
parsed by `--tool-call-parser`; with `--tool-choice-auto-grammar` a structural tag lets the
output be either plain text or one call in that parser's markup, so a base model can call
tools too. Streams send each call's arguments as they are generated. A call cut short by
max_tokens is kept as far as it was generated (its arguments may not be valid JSON), with
finish_reason "length", as OpenAI's API does: the non-streaming body then holds what the
stream sent, and the Responses API, which builds its output from the same deltas, gives the
same call. A `--reasoning-parser` first splits `<think>` reasoning from the answer.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_tool_call_id,
)
from pagedllm.entrypoints.openai.server_config import MAX_PARALLEL_TOOL_CALLS
from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedOutput, ToolParser, is_json_object
from pagedllm.entrypoints.openai.tool_parsers.json_scan import Status, scan_call_sequence, skip_ws
from pagedllm.sampling_params import StructuredOutputsParams

AUTO_TOOL_CHOICE_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
# --tool-choice-auto-grammar: for each parser, (trigger, start of a call up to its arguments, end of a call).
AUTO_GRAMMAR_MARKUP = {
    "hermes": ("<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"),
    "llama3_json": ("<|python_tag|>", '<|python_tag|>{{"name": {name}, "parameters": ', "}"),
    "mistral": ("[TOOL_CALLS]", '[TOOL_CALLS][{{"name": {name}, "arguments": ', "}]"),
}


def _tools_by_name(request: ChatCompletionRequest) -> dict[str, dict]:
    out = {}
    for tool in request.tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise OpenAIError("each tool must be {'type': 'function', 'function': {'name': ...}}", param="tools")
        if not isinstance(fn["name"], str):
            raise OpenAIError("a tool's function name must be a string", param="tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise OpenAIError(f"the parameters of tool {fn['name']!r} must be a JSON schema object", param="tools")
        out[fn["name"]] = params
    return out


def tool_mode(request: ChatCompletionRequest, auto_enabled: bool) -> tuple[str | None, str | None]:
    """('named', name) | ('required', None) | ('auto', None) | (None, None); 400 on misuse."""
    choice = request.tool_choice
    if choice is None:  # OpenAI's default: "auto" with tools, "none" without
        choice = "auto" if request.tools else "none"
    if choice == "none":
        return None, None
    tools = _tools_by_name(request)
    if not tools:
        raise OpenAIError(f"tool_choice={choice!r} needs `tools`", param="tool_choice")
    if choice == "auto":
        if not auto_enabled:
            raise OpenAIError(AUTO_TOOL_CHOICE_NEEDS_FLAGS, param="tool_choice")
        return "auto", None
    if choice == "required":
        return "required", None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in tools:
            raise OpenAIError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return "named", name
    raise OpenAIError("tool_choice must be 'none', 'auto', 'required' or a named function", param="tool_choice")


def tool_constraint(
    request: ChatCompletionRequest, mode: str | None, name: str | None, *,
    max_calls: int = MAX_PARALLEL_TOOL_CALLS, auto_grammar: str | None = None,
) -> StructuredOutputsParams | None:
    """The grammar for a tool mode: `auto_grammar` names the parser whose markup "auto" may use
    (None: "auto" is unconstrained)."""
    if mode == "named":
        return StructuredOutputsParams(json=_tools_by_name(request)[name], disable_any_whitespace=True)
    if mode == "required":
        item = {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": params},
             "required": ["name", "parameters"], "additionalProperties": False}
            for n, params in _tools_by_name(request).items()
        ]}
        most = 1 if request.parallel_tool_calls is False else max_calls
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1, "maxItems": most}
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    if mode == "auto" and auto_grammar is not None:
        trigger, begin, end = AUTO_GRAMMAR_MARKUP[auto_grammar]
        tags = [{"type": "tag", "begin": begin.format(name=json.dumps(n)), "end": end,
                 "content": {"type": "json_schema", "json_schema": params}}
                for n, params in _tools_by_name(request).items()]
        fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": False,
               "stop_after_first": True}
        return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})
    return None


class RequiredCallsParser(ToolParser):
    """What the `required` grammar produces: `[{"name": ..., "parameters": {...}}, ...]`."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if i == len(text):
            return ParsedOutput()
        if text[i] != "[":
            return ParsedOutput(valid=False)
        seq = scan_call_sequence(text, i + 1, sep=",", close="]")
        return ParsedOutput(calls=seq.calls, valid=seq.status is not Status.INVALID)


def _openai_deltas(calls: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """As OpenAI streams a call: first its id, type, name and arguments "", then argument pieces."""
    out = []
    for t in calls:
        args = t.function.arguments if t.function else None
        if t.id is not None and args:
            out.append(DeltaToolCall(index=t.index, id=t.id, type="function",
                                     function=DeltaFunctionCall(name=t.function.name, arguments="")))
            out.append(DeltaToolCall(index=t.index, function=DeltaFunctionCall(arguments=args)))
        else:
            out.append(t)
    return out


class ChoiceParser:
    """Per choice: splits reasoning, then extracts tool calls, whole or as stream deltas."""

    def __init__(self, mode: str | None, name: str | None, tool_parser: Any, reasoning_parser: Any) -> None:
        self.mode, self.name = mode, name
        self.tool_parser = RequiredCallsParser() if mode == "required" else tool_parser if mode == "auto" else None
        self.reasoning = reasoning_parser
        self.content = ""  # answer text so far (after reasoning)
        self.announced = False

    def final(self, text: str, truncated: bool = False) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, calls) of a whole output. `truncated` (max_tokens cut it): what
        a stream of it sends, an unfinished call included; call it on a fresh parser."""
        if truncated and self.mode is not None:
            return self._as_streamed(text)
        reasoning, content = (self.reasoning.extract_reasoning_content(text) if self.reasoning else (None, text))
        content = content or ""
        if self.mode == "named":  # the output is the arguments; cut short, it is no call
            calls = [ToolCall(function=FunctionCall(name=self.name, arguments=content))]
            return reasoning, None, calls if is_json_object(content) else []
        if self.mode == "required":  # the complete calls; one cut short is dropped
            parsed = self.tool_parser.parse(content, final=True)
            return reasoning, None, [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments))
                                     for c in parsed.calls if c.complete and not c.broken and c.name]
        if self.tool_parser is not None:
            extracted = self.tool_parser.extract_tool_calls(content)
            if extracted.tools_called:
                return reasoning, extracted.content, extracted.tool_calls
        return reasoning, content or None, []

    def _as_streamed(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """The whole text as one final stream delta, its call deltas joined per call."""
        d = self.delta("", text, finished=True) or DeltaMessage()
        calls: dict[int, ToolCall] = {}
        for t in d.tool_calls or []:
            args = (t.function.arguments if t.function else None) or ""
            if t.index not in calls:
                calls[t.index] = ToolCall(id=t.id or random_tool_call_id(),
                                          function=FunctionCall(name=t.function.name or "", arguments=args))
            else:
                calls[t.index].function.arguments += args
        return d.reasoning_content, d.content, [calls[i] for i in sorted(calls)]

    def delta(self, prev_text: str, text: str, finished: bool) -> DeltaMessage | None:
        if self.reasoning is not None:
            r, c = self.reasoning.extract_reasoning_content_streaming(prev_text, text, text[len(prev_text):])
            if finished:
                r2, c2 = self.reasoning.finish_streaming(text)
                r, c = (r or "") + (r2 or "") or None, (c or "") + (c2 or "") or None
        else:
            r, c = None, text[len(prev_text):] or None
        prev_content = self.content
        self.content += c or ""
        msg = DeltaMessage(reasoning_content=r)
        if self.mode == "named":
            calls = []
            if not self.announced and (c or finished):
                self.announced = True
                calls.append(DeltaToolCall(index=0, id=random_tool_call_id(), type="function",
                                           function=DeltaFunctionCall(name=self.name, arguments="")))
            if c:
                calls.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=c)))
            msg.tool_calls = calls or None
        elif self.tool_parser is not None:
            d = self.tool_parser.extract_tool_calls_streaming(prev_content, self.content, c or "")
            if finished:
                tail = self.tool_parser.finish_streaming(self.content)
                if tail is not None:
                    d = _merge(d, tail)
            if d is not None:
                msg.content = d.content
                msg.tool_calls = _openai_deltas([DeltaToolCall.model_validate(t.model_dump())
                                                 for t in d.tool_calls]) or None
        else:
            msg.content = c
        if msg.content is None and msg.reasoning_content is None and not msg.tool_calls:
            return None
        return msg

    @property
    def called_tools(self) -> bool:
        if self.mode in ("named", "required"):
            return True
        return bool(self.tool_parser is not None and self.tool_parser.streamed_tool_calls)


def _merge(a: Any, b: Any) -> Any:
    if a is None:
        return b
    a.content = (a.content or "") + (b.content or "") or None
    a.tool_calls = list(a.tool_calls) + list(b.tool_calls)
    return a
