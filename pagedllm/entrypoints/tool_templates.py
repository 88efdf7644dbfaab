"""Tool-aware chat templates shipped for model families whose own template ignores tools.

A template without tool support drops a request's `tools`, renders an assistant turn that
only called tools as an empty turn, and tool results as plain user text, so the model never
learns it may call anything. For such a model, a request that carries tools (or tool calls
and results in its history) renders with the family's shipped template instead: it lists the
tools and writes calls in the markup the named `--tool-call-parser` reads back, so a call the
model copies from its prompt is parsed. `--chat-template` (or a request's own template)
always wins; the switch is logged once per family."""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_TEMPLATE_DIR = Path(__file__).parent / "templates"
_COMMENT = re.compile(r"\{#.*?#\}", re.S)
_TOOLS_VAR = re.compile(r"\btools\b")
_TOOL_CALLS = re.compile(r"\btool_calls\b")


@dataclass(frozen=True, slots=True)
class ToolTemplate:
    family: str
    file: str  # templates/<file>.jinja
    parser: str  # the --tool-call-parser that reads its call markup back
    markers: tuple[str, ...]  # single tokens of the family's vocabulary that identify it


# In detection order: a vocabulary holding all of an entry's markers is that family's. ChatML
# (<|im_start|>) comes late: Granite and Phi vocabularies may hold it beside their own markers.
TOOL_TEMPLATES: tuple[ToolTemplate, ...] = (
    ToolTemplate("gemma3", "tool_gemma3", "hermes", ("<start_of_turn>", "<end_of_turn>")),
    ToolTemplate("llama3", "tool_llama3", "llama3_json", ("<|start_header_id|>", "<|eot_id|>")),
    ToolTemplate("granite", "tool_granite", "hermes", ("<|start_of_role|>", "<|end_of_role|>")),
    ToolTemplate("mistral", "tool_mistral", "mistral", ("[INST]", "[/INST]")),
    ToolTemplate("phi3", "tool_phi3", "hermes", ("<|user|>", "<|assistant|>", "<|end|>")),
    ToolTemplate("qwen", "tool_qwen", "hermes", ("<|im_start|>", "<|im_end|>")),
)


def _is_token(tokenizer: Any, text: str) -> bool:
    try:
        tid = tokenizer.convert_tokens_to_ids(text)
    except Exception:  # a tokenizer without the lookup: nothing is recognised
        return False
    return isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None)


def tool_template_of(tokenizer: Any) -> ToolTemplate | None:
    """The family's entry, told by its vocabulary's turn markers (so fine-tunes and GGUF
    conversions whose config names another model type are recognised too)."""
    for entry in TOOL_TEMPLATES:
        if all(_is_token(tokenizer, m) for m in entry.markers):
            return entry
    return None


@functools.lru_cache(maxsize=32)
def supports_tools(source: str) -> bool:
    """Whether a template reads `tools` and renders assistant `tool_calls` (comments aside)."""
    code = _COMMENT.sub("", source)
    return bool(_TOOLS_VAR.search(code) and _TOOL_CALLS.search(code))


def uses_tools(messages: list[dict[str, Any]], tools: Any) -> bool:
    """A request with tools, or a history with tool calls or results."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


@functools.cache
def load_tool_template(file: str) -> str:
    return (_TEMPLATE_DIR / f"{file}.jinja").read_text(encoding="utf-8")


_logged: set[str] = set()


def _log_once(key: str, message: str, *args: Any, level: int = logging.INFO) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, message, *args)


def tool_template_for(tokenizer: Any, own: str) -> str | None:
    """The shipped tool template to render a tool-using conversation with, when the model's
    own template `own` has no tool support; None to keep `own`."""
    if supports_tools(own):
        return None
    entry = tool_template_of(tokenizer)
    if entry is None:
        _log_once("unknown", "the model's chat template has no tool support and pagedllm ships no tool template "
                  "for its family: tools will not reach the prompt; pass --chat-template with a tool-aware "
                  "template", level=logging.WARNING)
        return None
    _log_once(entry.family, "the model's chat template has no tool support: requests with tools render with "
              "pagedllm's %s tool template (templates/%s.jinja; calls read back by --tool-call-parser %s); "
              "--chat-template overrides it", entry.family, entry.file, entry.parser)
    return load_tool_template(entry.file)
