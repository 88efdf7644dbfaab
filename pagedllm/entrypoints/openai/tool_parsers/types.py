"""Wire shapes of tool calls, kept here until protocol.py grows them.

They mirror OpenAI's chat schema exactly (`tool_calls[i] = {id, type: "function", function: {name,
arguments}}`, stream items `{index, id?, type?, function: {name?, arguments?}}`) so that serving code can
drop them into a response unchanged; `arguments` is always a JSON *string*, as OpenAI clients expect.
"""

from __future__ import annotations

import secrets
import string
import uuid
from typing import Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel

_ALNUM = string.ascii_letters + string.digits


def random_tool_call_id() -> str:
    """OpenAI-style id (`call_` + 24 hex chars): unique per call so clients can pair results with calls."""
    return f"call_{uuid.uuid4().hex[:24]}"


def random_mistral_tool_call_id() -> str:
    """Mistral's chat templates reject any tool-call id that is not exactly 9 alphanumerics."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=random_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall = Field(default_factory=DeltaFunctionCall)


class DeltaMessage(OpenAIBaseModel):
    """A stream delta as the tool parser sees it: a superset of protocol.DeltaMessage.

    `tool_calls` defaults to empty; dump with `exclude_none=True` and drop an empty list to get
    exactly what OpenAI sends."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ExtractedToolCalls(OpenAIBaseModel):
    """Result of parsing a whole completion: the calls plus the text that is still ordinary content."""

    tools_called: bool
    tool_calls: list[ToolCall] = Field(default_factory=list)
    content: str | None = None
