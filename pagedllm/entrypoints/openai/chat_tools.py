"""Tool calling and reasoning for chat completions.

`tool_choice="required"` and a named function are enforced with structured outputs (a JSON
schema built from the tools), so even a model never trained for tools produces valid calls.
`tool_choice="auto"` relies on the model's own markup, parsed by `--tool-call-parser`.
A `--reasoning-parser` first splits `<think>` reasoning from the answer.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_tool_call_id,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIError
from pagedllm.sampling_params import StructuredOutputsParams


def _tools_by_name(request: ChatCompletionRequest) -> dict[str, dict]:
    out = {}
    for tool in request.tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise OpenAIError("each tool must be {'type': 'function', 'function': {'name': ...}}", param="tools")
        out[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    return out


def tool_mode(request: ChatCompletionRequest, auto_enabled: bool) -> tuple[str | None, str | None]:
    """('named', name) | ('required', None) | ('auto', None) | (None, None); 400 on misuse."""
    choice = request.tool_choice
    if choice is None:  # OpenAI's default with tools is "auto"; without the parser there is no auto
        choice = "auto" if request.tools and auto_enabled else "none"
    if choice == "none":
        return None, None
    tools = _tools_by_name(request)
    if not tools:
        raise OpenAIError(f"tool_choice={choice!r} needs `tools`", param="tool_choice")
    if choice == "auto":
        if not auto_enabled:
            raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser',
                              param="tool_choice")
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
    request: ChatCompletionRequest, mode: str | None, name: str | None
) -> StructuredOutputsParams | None:
    tools = _tools_by_name(request) if mode in ("named", "required") else {}
    if mode == "named":
        return StructuredOutputsParams(json=tools[name], disable_any_whitespace=True)
    if mode == "required":
        item = {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": params},
             "required": ["name", "parameters"], "additionalProperties": False}
            for n, params in tools.items()
        ]}
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return None


class ChoiceParser:
    """Per choice: splits reasoning, then extracts tool calls, whole or as stream deltas."""

    def __init__(self, mode: str | None, name: str | None, tool_parser: Any, reasoning_parser: Any) -> None:
        self.mode, self.name = mode, name
        self.tool_parser = tool_parser if mode == "auto" else None
        self.reasoning = reasoning_parser
        self.content = ""  # answer text so far (after reasoning)
        self.announced = False

    def final(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        reasoning, content = (self.reasoning.extract_reasoning_content(text) if self.reasoning else (None, text))
        content = content or ""
        if self.mode == "named":
            return reasoning, None, [ToolCall(function=FunctionCall(name=self.name, arguments=content))]
        if self.mode == "required":
            try:
                calls = json.loads(content)
                return reasoning, None, [
                    ToolCall(function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"])))
                    for c in calls
                ]
            except (ValueError, KeyError, TypeError):  # cut short (max_tokens): hand back the text
                return reasoning, content or None, []
        if self.tool_parser is not None:
            extracted = self.tool_parser.extract_tool_calls(content)
            if extracted.tools_called:
                return reasoning, extracted.content, extracted.tool_calls
        return reasoning, content or None, []

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
        elif self.mode == "required":
            if finished:  # the array is known only once complete
                _, content, calls = self.final_content(self.content)
                msg.content = content
                msg.tool_calls = [DeltaToolCall(index=i, id=t.id, type="function",
                                                function=DeltaFunctionCall(name=t.function.name,
                                                                           arguments=t.function.arguments))
                                  for i, t in enumerate(calls)] or None
        elif self.tool_parser is not None:
            d = self.tool_parser.extract_tool_calls_streaming(prev_content, self.content, c or "")
            if finished:
                tail = self.tool_parser.finish_streaming(self.content)
                if tail is not None:
                    d = _merge(d, tail)
            if d is not None:
                msg.content = d.content
                msg.tool_calls = [DeltaToolCall.model_validate(t.model_dump()) for t in d.tool_calls] or None
        else:
            msg.content = c
        if msg.content is None and msg.reasoning_content is None and not msg.tool_calls:
            return None
        return msg

    def final_content(self, content: str) -> tuple[None, str | None, list[ToolCall]]:
        saved, self.reasoning = self.reasoning, None
        try:
            return self.final(content)
        finally:
            self.reasoning = saved

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
