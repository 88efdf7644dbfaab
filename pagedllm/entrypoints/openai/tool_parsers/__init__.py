"""Tool-call parsers: turn a model's tool-call markup into OpenAI `tool_calls`, whole or streamed.

`ToolParserManager.get(name)` gives the class for `--tool-call-parser name`; importing this package
registers the built-in ones (hermes, llama3_json, mistral, pythonic).
"""

from pagedllm.entrypoints.openai.tool_parsers import hermes, llama3_json, mistral, pythonic  # noqa: F401
from pagedllm.entrypoints.openai.tool_parsers.abstract import ToolParser, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
)

__all__ = [
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionCall",
    "ToolCall",
    "ToolParser",
    "ToolParserManager",
]
