"""Fitting a conversation to a strict chat template.

OpenAI's API accepts repeated roles: two user messages in a row, and one `tool` message per
result after an assistant turn that made parallel calls. Many templates (Gemma's, older
Mistral and Llama 2 ones) raise unless user and assistant alternate. A conversation is
rendered as given first, so a template that accepts it sees exactly what the client sent;
only when the template raises is it rendered again with its turns fitted: tool results keep
the template's own tool turn where it has one (else they become user turns), and consecutive
turns of one role merge into one. If no form renders, the error of the most fitted one is
reported: it names what fitting could not fix."""

from __future__ import annotations

import functools
import re
from typing import Any

from pagedllm.entrypoints.chat_template import TemplateRejectedError, render_template

_COMMENT = re.compile(r"\{#.*?#\}", re.S)
# A template that names the tool role (Llama 3.1 calls it "ipython") gives tool results a turn of their own.
_TOOL_ROLE = re.compile(r"""["'](?:tool|ipython)["']""")
_JOIN = "\n\n"


@functools.lru_cache(maxsize=32)
def has_tool_turn(source: str) -> bool:
    """Whether the template treats the `tool` role itself (comments do not count)."""
    return bool(_TOOL_ROLE.search(_COMMENT.sub("", source)))


def _merge(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One turn from two of the same role: texts joined by a blank line, tool calls in order."""
    merged = dict(first)
    merged["content"] = _JOIN.join(c for c in (first.get("content"), second.get("content")) if c)
    calls = list(first.get("tool_calls") or []) + list(second.get("tool_calls") or [])
    if calls:
        merged["tool_calls"] = calls
    return merged


def fit_turns(messages: list[dict[str, Any]], *, tool_turn: bool) -> list[dict[str, Any]]:
    """The conversation with alternating turns: with `tool_turn`, tool results stay `tool`
    messages (one each, so each keeps its tool_call_id); without, they are user text. Then
    each run of messages of one role (but `tool`) becomes one message."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool" and not tool_turn:
            message = {"role": "user", "content": message.get("content") or ""}
        if out and out[-1]["role"] == message["role"] != "tool":
            out[-1] = _merge(out[-1], message)
        else:
            out.append(dict(message))
    return out


def render_fitted(source: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """render_template, and when the template rejects the conversation, its fitted forms:
    first with the template's own tool turn (if it has one), then with tool results as user
    text. Limits (time, size) are never retried: only what the template itself raised."""
    try:
        return render_template(source, messages, **kwargs)
    except TemplateRejectedError as error:
        last = error
    tried = [messages]
    for tool_turn in ((True, False) if has_tool_turn(source) else (False,)):
        fitted = fit_turns(messages, tool_turn=tool_turn)
        if fitted in tried:
            continue
        tried.append(fitted)
        try:
            return render_template(source, fitted, **kwargs)
        except TemplateRejectedError as error:
            last = error
    raise last
