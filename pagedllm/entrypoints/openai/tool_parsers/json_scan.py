"""Scanning JSON tool calls that may still be arriving.

Streaming needs three answers about a text that ends mid-way: is it still a valid *prefix* (wait for more),
already invalid (give up on it), or complete (and where does it end)? `json` can only say "not valid yet", so
this module scans the structure itself: strings/numbers by regex (C speed), containers by a small
recursive walk. A call object's arguments are kept as the model's raw JSON text: streaming their growing
prefix, and using the same text when complete, makes the concatenated deltas equal the final string exactly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, is_json_object

ARG_KEYS = ("arguments", "parameters")
_WS = re.compile(r"[ \t\n\r]*")
# unambiguous ("unrolled") so a string that is not closed yet fails in linear time, not exponential
_CHARS = r'[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*'
_STRING = re.compile(f'"{_CHARS}"')
_STRING_PREFIX = re.compile(f'"{_CHARS}(?:\\\\(?:u[0-9a-fA-F]{{0,3}})?)?\\Z')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_TAIL = re.compile(r"\.|[eE][+-]?")  # what may still extend a number at the end of the text


class JsonIncomplete(Exception):
    """The text ends inside a value that is valid so far."""


class JsonInvalid(Exception):
    """No continuation of the text can make the value valid."""


def skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _no_constants(name: str) -> float:
    raise ValueError(name)  # NaN/Infinity are not JSON; clients' parsers would reject them


_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def value_end(text: str, i: int) -> int:
    """Index just past the JSON value starting at text[i]; raises JsonIncomplete or JsonInvalid."""
    if i >= len(text):
        raise JsonIncomplete
    try:
        _, end = _DECODER.raw_decode(text, i)
    except (ValueError, RecursionError):
        pass
    else:
        if end == len(text) and text[i] in "-0123456789":
            raise JsonIncomplete  # more digits may follow
        return end
    try:
        return _scan(text, i)
    except RecursionError:
        raise JsonInvalid from None


def _scan(text: str, i: int) -> int:
    n = len(text)
    if i >= n:
        raise JsonIncomplete
    c = text[i]
    if c == '"':
        m = _STRING.match(text, i)
        if m:
            return m.end()
        raise JsonIncomplete if _STRING_PREFIX.match(text, i) else JsonInvalid
    if c in "{[":
        close = "}" if c == "{" else "]"
        i = skip_ws(text, i + 1)
        if i < n and text[i] == close:
            return i + 1
        while True:
            if c == "{":
                if i < n and text[i] != '"':
                    raise JsonInvalid
                i = skip_ws(text, _scan(text, i))
                if i >= n:
                    raise JsonIncomplete
                if text[i] != ":":
                    raise JsonInvalid
                i = skip_ws(text, i + 1)
            i = skip_ws(text, _scan(text, i))
            if i >= n:
                raise JsonIncomplete
            if text[i] == close:
                return i + 1
            if text[i] != ",":
                raise JsonInvalid
            i = skip_ws(text, i + 1)
    if c == "-" or c.isdigit():
        m = _NUMBER.match(text, i)
        if m is None:
            if i + 1 == n:
                raise JsonIncomplete
            raise JsonInvalid
        if m.end() == n or _NUMBER_TAIL.fullmatch(text, m.end()):
            raise JsonIncomplete
        return m.end()
    for lit in ("true", "false", "null"):
        if text.startswith(lit, i):
            return i + len(lit)
        if n - i < len(lit) and lit.startswith(text[i:]):
            raise JsonIncomplete
    raise JsonInvalid


@dataclass
class ObjectScan:
    call: ParsedCall | None  # None until the object has a complete string "name"
    end: int | None  # index past the closing brace, once complete
    invalid: bool = False


def scan_call_object(text: str, i: int) -> ObjectScan:
    """Scan `{"name": ..., "arguments"|"parameters": {...}, ...}` starting at text[i] == "{"."""
    found: dict[str, int] = {}  # "name"/"args" -> value start, "name_end"/"args_end" -> value end
    end: int | None = None
    invalid = False
    try:
        end = _walk_object(text, i, found)
    except JsonIncomplete:
        pass
    except JsonInvalid:
        invalid = True
    name = json.loads(text[found["name"]:found["name_end"]]) if "name_end" in found else None
    if name is None:
        return ObjectScan(None, end, invalid)
    start, args_end = found.get("args"), found.get("args_end")
    if invalid:
        args = ""
    elif start is None:
        args = "{}" if end is not None else ""
    elif text[start] == "{":
        args = text[start:len(text) if args_end is None else args_end]
    elif args_end is None:
        args = ""
    elif text[start] == '"':
        args = json.loads(text[start:args_end])  # arguments sent as a JSON-encoded string
    else:
        args = "{}"  # null
    return ObjectScan(ParsedCall(name, args, complete=end is not None, broken=invalid), end, invalid)


def _walk_object(text: str, i: int, found: dict[str, int]) -> int:
    n = len(text)
    i = skip_ws(text, i + 1)
    if i < n and text[i] == "}":
        return i + 1
    while True:
        if i >= n:
            raise JsonIncomplete
        if text[i] != '"':
            raise JsonInvalid
        k_end = value_end(text, i)
        key = json.loads(text[i:k_end])
        i = skip_ws(text, k_end)
        if i >= n:
            raise JsonIncomplete
        if text[i] != ":":
            raise JsonInvalid
        i = skip_ws(text, i + 1)
        slot = "name" if key == "name" else "args" if key in ARG_KEYS else None
        if slot in found:
            raise JsonInvalid  # a second name/arguments: ambiguous
        if slot == "name" and i < n and text[i] != '"':
            raise JsonInvalid
        if slot == "args" and i < n and text[i] not in '{"n':
            raise JsonInvalid
        if slot and i < n:
            found[slot] = i
        v_end = value_end(text, i)
        if slot == "name" and not json.loads(text[i:v_end]).strip():
            raise JsonInvalid  # a call needs a function name
        if slot:
            found[slot + "_end"] = v_end
        if slot == "args" and text[i] == '"' and not is_json_object(json.loads(text[i:v_end])):
            raise JsonInvalid
        i = skip_ws(text, v_end)
        if i >= n:
            raise JsonIncomplete
        if text[i] == "}":
            return i + 1
        if text[i] != ",":
            raise JsonInvalid
        i = skip_ws(text, i + 1)


class Status(Enum):
    PENDING = "pending"  # the text ends inside the sequence
    DONE = "done"  # the sequence ended at `end`
    INVALID = "invalid"  # malformed after it was recognised as calls
    NOT_CALLS = "not_calls"  # the first item is not a call: the text is ordinary content


@dataclass
class SequenceScan:
    status: Status
    calls: list[ParsedCall] = field(default_factory=list)
    end: int | None = None
    open_item: bool = False  # PENDING inside an object (rather than between items)


def scan_call_sequence(text: str, i: int, sep: str | None, close: str | None) -> SequenceScan:
    """Call objects separated by `sep`, up to `close` (if any) or the first thing that is not `sep`."""
    res = SequenceScan(Status.PENDING)
    n = len(text)
    while True:
        i = skip_ws(text, i)
        if i >= n:
            return res
        if close is not None and text[i] == close:
            res.status, res.end = Status.DONE, i + 1
            return res
        if text[i] != "{":
            res.status = Status.INVALID if res.calls else Status.NOT_CALLS
            return res
        obj = scan_call_object(text, i)
        if obj.call is not None:
            res.calls.append(obj.call)
        if obj.invalid or (obj.end is not None and obj.call is None):
            res.status = Status.INVALID if res.calls else Status.NOT_CALLS
            return res
        if obj.end is None:
            res.open_item = True
            return res
        i = skip_ws(text, obj.end)
        if i >= n:
            return res
        if sep is not None and text[i] == sep:
            i += 1
            continue
        if close is not None:
            res.status, res.end = (Status.DONE, i + 1) if text[i] == close else (Status.INVALID, None)
            return res
        res.status, res.end = Status.DONE, obj.end
        return res
