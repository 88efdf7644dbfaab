"""Pythonic tool calls (Llama 3.2 / Llama 4 style): the output is a Python list of calls,
`[get_weather(city="Paris"), get_time()]`, optionally inside `<|python_start|>...<|python_end|>`.

Only keyword arguments with literal values are accepted (`ast.literal_eval`): evaluating anything else
would run model-written code. Arguments become `json.dumps` of the keyword dict; streaming sends that JSON
one finished keyword argument at a time, so the pieces concatenate to exactly the final string. The final
parse is checked against `ast.parse` of the whole list, so only what Python itself accepts is a call.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    ToolParserManager,
    join_content,
)
from pagedllm.entrypoints.openai.tool_parsers.json_scan import SequenceScan, Status, skip_ws

START, END = "<|python_start|>", "<|python_end|>"
_IDENT = re.compile(r"[^\W\d]\w*")


class _Invalid(Exception):
    pass


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


@functools.lru_cache(maxsize=4096)
def _literal_json(source: str) -> str:
    """JSON of a Python literal; cached because streaming re-reads finished arguments on every delta."""
    try:
        return _dumps(ast.literal_eval(source.strip()))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _Invalid from None


# Regexes rather than a per-character loop: streaming rescans the list on every delta.
_SPECIAL = re.compile(r"[\"'()\[\]{},]")
_BODY = {q: re.compile(rf"[^{q}\\\n]*(?:\\[\s\S][^{q}\\\n]*)*{q}") for q in "'\""}  # after the quote
_BODY3 = {q: re.compile(rf"[^{q}\\]*(?:(?:\\[\s\S]|{q}(?!{q}{q}))[^{q}\\]*)*{q}{q}{q}") for q in "'\""}


def _value_end(text: str, i: int) -> int | None:
    """Index of the `,` or `)` that ends the argument value starting at i; None if the text ends first."""
    n, depth = len(text), 0
    while True:
        m = _SPECIAL.search(text, i)
        if m is None:
            return None
        i, c = m.start(), m.group()
        if c in "\"'":
            if text.startswith(c * 3, i):
                body = _BODY3[c].match(text, i + 3)
            elif i + 2 == n and text[i + 1] == c:
                return None  # `""` at the end may be the start of a triple quote
            else:
                body = _BODY[c].match(text, i + 1)
            if body is None:
                rest = text[i:]
                if c * 3 == rest[:3] or "\n" not in rest.replace("\\\n", ""):
                    return None  # the string is still arriving
                raise _Invalid  # a newline inside a one-line string
            i = body.end()
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                if c == ")":
                    return i
                raise _Invalid
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1


def _scan_args(text: str, i: int, call: ParsedCall) -> int | None:
    """Keyword arguments from text[i] (just after `(`): index past `)`, or None while still arriving."""
    n, args = len(text), {}
    while True:
        i = skip_ws(text, i)
        if i >= n:
            return None
        if text[i] == ")":
            call.arguments = call.arguments + "}" if args else "{}"
            call.complete = True
            return i + 1
        m = _IDENT.match(text, i)
        if m is None:
            raise _Invalid  # positional arguments, *args, junk
        k = skip_ws(text, m.end())
        if k + 1 >= n:
            return None
        if text[k] != "=" or text[k + 1] == "=" or m.group() in args:
            raise _Invalid
        end = _value_end(text, k + 1)
        if end is None:
            return None
        piece = f"{_dumps(m.group())}: {_literal_json(text[k + 1:end])}"
        args[m.group()] = piece
        call.arguments = call.arguments + ", " + piece if len(args) > 1 else "{" + piece
        i = end + 1 if text[end] == "," else end


def _scan_list(text: str, i: int) -> SequenceScan:
    res, n = SequenceScan(Status.PENDING), len(text)
    while True:
        i = skip_ws(text, i)
        if i >= n:
            return res
        if text[i] == "]":
            res.status, res.end = (Status.DONE, i + 1) if res.calls else (Status.NOT_CALLS, None)
            return res
        m = _IDENT.match(text, i)
        j = skip_ws(text, m.end()) if m else i
        if m and j >= n:
            return res  # the name may go on, or `(` may follow
        if m is None or text[j] != "(":
            res.status = Status.INVALID if res.calls else Status.NOT_CALLS
            return res
        call = ParsedCall(m.group(), "")
        res.calls.append(call)
        try:
            end = _scan_args(text, j + 1, call)
        except _Invalid:
            call.broken, res.status = True, Status.INVALID
            return res
        if end is None:
            res.open_item = True
            return res
        i = skip_ws(text, end)
        if i < n and text[i] == ",":
            i += 1
        elif i < n:
            res.status, res.end = (Status.DONE, i + 1) if text[i] == "]" else (Status.INVALID, None)
            return res


def _ast_calls(source: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call, per Python's own parser; None if it is not a literal call list."""
    try:
        tree = ast.parse(source, mode="eval")
        if not isinstance(tree.body, ast.List):
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            if any(kw.arg is None for kw in node.keywords):
                return None  # **kwargs
            calls.append((node.func.id, _dumps({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})))
        return calls
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


@ToolParserManager.register("pythonic")
class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if text.startswith(START, i):
            i = skip_ws(text, i + len(START))
        elif not final and START.startswith(text[i:]):
            return ParsedOutput()  # nothing yet, or the start tag is arriving
        if not final and i == len(text):
            return ParsedOutput()
        if not text.startswith("[", i):
            return ParsedOutput(content=text)
        scan = _scan_list(text, i + 1)
        if scan.status is Status.NOT_CALLS or (final and scan.status is Status.PENDING and not scan.calls):
            return ParsedOutput(content=text)
        out = ParsedOutput(calls=scan.calls)
        after = ""
        if scan.status is Status.DONE and scan.end is not None:
            after = text[scan.end:]
            j = skip_ws(after, 0)
            if after.startswith(END, j):
                after = after[j + len(END):]
            if final:
                checked = _ast_calls(text[i:scan.end])
                if checked is None or len(checked) != len(out.calls):
                    out.valid = False
                else:
                    for call, (name, arguments) in zip(out.calls, checked):
                        call.name, call.arguments = name, arguments
        elif scan.status is not Status.PENDING or final:
            out.valid = False
        out.content = join_content(["", after], final, (END,))
        return out
