"""Checks on a whole parsed request body, before and after pydantic validates it: how deep it
nests, and that no string or float in it is one the tokenizer or sampler cannot take. Their
errors are pydantic's custom "pagedllm_invalid_value", whose message names the place."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

from pydantic_core import PydanticCustomError

# How deep a request body's JSON may nest (the body itself is level 1). A tool's or
# response_format's schema sits 4 to 6 levels down, and OpenAI's strict schemas nest objects at
# most 10 deep, about 40 levels more; past 64 it is an attack on every recursive walk after
# parsing (deepcopy, pydantic, the chat template's tojson, the grammar compiler).
MAX_JSON_DEPTH = 64

_CONTAINERS = (dict, list, tuple)


def check_depth(data: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """At most `limit` levels of nested objects and arrays; the error names the top-level field."""
    if not isinstance(data, dict):  # not a body pydantic accepts; bounded all the same
        fields, room = [("body", data)], limit
    else:
        fields, room = data.items(), limit - 1  # the body is the first level
    for name, value in fields:
        if isinstance(value, _CONTAINERS) and _depth(value, room + 1) > room:
            raise PydanticCustomError(
                "pagedllm_invalid_value", "{param}: JSON nested more than {limit} levels deep (the most a "
                "request may nest)", {"param": str(name), "limit": str(limit)})


def _depth(value: Any, limit: int) -> int:
    """How many levels of containers `value` holds, counting up to `limit` (the body around it is
    one more). Level by level, without recursion; a level holding no container is dismissed by
    one C-level pass over its values' types, so a long token-id list costs little."""
    level, depth = [value], 1
    while depth < limit:
        values = list(itertools.chain.from_iterable(v.values() if isinstance(v, dict) else v for v in level))
        if not any(issubclass(t, _CONTAINERS) for t in set(map(type, values))):
            return depth
        level = [v for v in values if isinstance(v, _CONTAINERS)]
        depth += 1
    return depth


def check_values(data: Any) -> None:
    """No lone surrogate in any string or key, no non-finite float, anywhere in a parsed
    JSON body. json.dumps walks it in C and fails on exactly these (allow_nan=False, then the
    strict UTF-8 encode), so a large valid body costs little; only a failing one is walked
    again in Python, to name the place."""
    try:
        json.dumps(data, ensure_ascii=False, allow_nan=False).encode("utf-8")
        return
    except (ValueError, TypeError, RecursionError):  # UnicodeEncodeError is a ValueError
        pass
    stack = [(data, "")]  # iterative: a deeply nested body cannot exhaust the stack
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise PydanticCustomError(
                    "pagedllm_invalid_value", "{param}: must be a finite number, got {value}",
                    {"param": path or "body", "value": str(value)},
                )
        elif isinstance(value, dict):
            items = []
            for k, v in value.items():
                key_path = f"{path}.{k}" if path else str(k)
                if isinstance(k, str):
                    _check_text(k, key_path)
                items.append((v, key_path))
            stack.extend(reversed(items))  # popped in document order: the first problem is reported
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed([(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)]))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = path.encode("utf-8", "backslashreplace").decode("utf-8") or "body"
        raise PydanticCustomError(
            "pagedllm_invalid_value", "{param}: text is not valid Unicode (lone surrogate {char} at {pos})",
            {"param": where, "char": f"U+{ord(text[e.start]):04X}", "pos": str(e.start)},
        ) from None
