"""Wire shapes of tool calls, kept here until protocol.py grows them.

They mirror OpenAI's chat schema exactly (`tool_calls[i] = {id, type: "function", function: {name,
arguments}}`, stream items `{index, id?, type?, function: {name?, arguments?}}`) so that serving code can
drop them into a response unchanged; `arguments` is always a JSON *string*, as OpenAI clients expect.
"""

from __future__ import annotations

import secrets
import string

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import (  # noqa: F401 (re-exported for the parsers)
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    OpenAIBaseModel,
    ToolCall,
    random_tool_call_id,
)

_ALNUM = string.ascii_letters + string.digits


def random_mistral_tool_call_id() -> str:
    """Mistral's chat templates reject any tool-call id that is not exactly 9 alphanumerics."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


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
