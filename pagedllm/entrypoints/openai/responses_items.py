"""Responses API items: a request's `input` checked and normalised into stored items (each
with an id), and any list of items (history, conversation, new input, model output) turned
into the chat messages the chat template renders. Text, images (`input_image` parts of user
messages, kept as their URL; a text-only model answers them with a 400) and function tools: a
file part, or an unknown item type, is a 400 naming the item."""

from __future__ import annotations

import uuid
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    """A message's or a tool output's content as one string (text parts joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where}: content must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise OpenAIError(f"{where}[{j}]: content part type {kind!r} is not supported by this text-only server; "
                              f"use one of {', '.join(_TEXT_PARTS[:2])}", param=where)
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise OpenAIError(f"{where}[{j}]: a {kind} part needs a string `text`", param=where)
        texts.append(text)
    return "".join(texts)


def _message_content(content: Any, role: str, where: str) -> list[dict[str, Any]]:
    """A message's stored parts: its text as one part, and a user message's images (input_image,
    by URL) where they are among the text."""
    if role == "assistant" or not isinstance(content, list) or \
            not any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        text = _text_of(content, where)
        part = "output_text" if role == "assistant" else "input_text"
        return [{"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}]
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise OpenAIError(f"{where}[{j}]: an input_image part needs an image_url string (a file_id is not "
                                  "supported)", param=where)
            parts.append({"type": "input_image", "image_url": url, "detail": part.get("detail") or "auto"})
        else:
            parts.append({"type": "input_text", "text": _text_of([part], f"{where}[{j}]")})
    return parts


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise OpenAIError(f"{where}: a {item.get('type')} item needs a string `{key}`", param=where)
    return value


def normalize_item(item: Any, where: str) -> dict[str, Any]:
    """One input item in its stored form: type, id and status filled in, text parts typed."""
    if not isinstance(item, dict):
        raise OpenAIError(f"{where}: an item must be an object", param=where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise OpenAIError(f"{where}: role must be one of {', '.join(_ROLES)}, got {role!r}", param=where)
        content = _message_content(item.get("content"), role, f"{where}.content")
        return {"id": item.get("id") or new_id("msg"), "type": "message", "role": role, "content": content,
                "status": "completed"}
    if kind == "function_call":
        return {"id": item.get("id") or new_id("fc"), "type": "function_call",
                "call_id": _string(item, "call_id", where), "name": _string(item, "name", where),
                "arguments": _string(item, "arguments", where), "status": "completed"}
    if kind == "function_call_output":
        output = item.get("output")
        _text_of(output, f"{where}.output")
        return {"id": item.get("id") or new_id("fco"), "type": "function_call_output",
                "call_id": _string(item, "call_id", where), "output": output, "status": "completed"}
    if kind == "reasoning":  # an earlier turn's thinking: kept for the record, not shown to the model again
        return {"id": item.get("id") or new_id("rs"), "type": "reasoning", "summary": item.get("summary") or [],
                "content": item.get("content") or []}
    raise OpenAIError(f"{where}: item type {kind!r} is not supported; use message, function_call, "
                      "function_call_output or reasoning", param=where)


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    """OpenAI's bounds on a response's or a conversation's metadata."""
    metadata = metadata or {}
    if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise OpenAIError("metadata holds at most 16 pairs, keys of at most 64 and values of 512 characters",
                          param="metadata")
    return metadata


def normalize_input(value: str | list[Any], param: str = "input") -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [normalize_item({"role": "user", "content": value}, param)] if value else []
    return [normalize_item(item, f"{param}[{i}]") for i, item in enumerate(value)]


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored items → chat messages. Consecutive function calls join the assistant message
    before them (one turn that called several tools); a tool output names its function."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            parts = item["content"]
            if any(p["type"] == "input_image" for p in parts):  # the chat renderer takes the images
                content: Any = [p if p["type"] == "input_image" else {"type": "text", "text": p["text"]}
                                for p in parts]
            else:
                content = _text_of(parts, "item")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(item["output"], "item")}
            if item["call_id"] in names:
                message["name"] = names[item["call_id"]]
            messages.append(message)
    return messages


def pending_calls(items: list[dict[str, Any]]) -> list[str]:
    """Call ids of function calls in `items` that no function_call_output answers yet."""
    answered = {i["call_id"] for i in items if i["type"] == "function_call_output"}
    return [i["call_id"] for i in items if i["type"] == "function_call" and i["call_id"] not in answered]


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools → chat's {"type": "function", "function": {...}}."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise OpenAIError(f"tools[{i}]: only function tools are supported, got {tool.get('type')!r}",
                              param="tools")
        if "function" in tool:  # already in the chat shape
            out.append(tool)
            continue
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """{"type": "function", "name": ...} → chat's {"type": "function", "function": {"name": ...}}."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice
