"""Size checks the chat-template sandbox runs *before* an operation builds its value.

Checking a result after it exists is too late when one C call can build hundreds of megabytes
(`([s] * 64) | join`, `s.replace('a', 'b' * 64)`, `a ~ a` doubled in a loop), so each
operation that can multiply sizes first computes, cheaply, how large its result would be."""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Callable
from typing import Any

from jinja2.utils import Namespace

_FORMAT_WIDTHS = re.compile(r"(?:%|:)[-#0 +<>^=_,]*(\d*)(?:\.(\d+))?")
_SCALAR_CHARS = 32  # str() of a float, bool, None or an unknown object, roughly
_TIME_CHECK_EVERY = 4096  # nodes walked by text_size between deadline checks


_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class ChatTemplateError(ValueError):
    """The template failed, ran too long or produced too much: the request's fault."""


class Budget:
    """Deadline and size limit of the render in progress (one per render call)."""

    __slots__ = ("deadline", "max_chars")

    def __init__(self, timeout_s: float, max_chars: int) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.max_chars = max_chars

    def check_time(self, what: str = "render") -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"the chat template took too long to {what}")

    def check_size(self, n: int, what: str = "a value") -> None:
        if n > self.max_chars:
            raise ChatTemplateError(f"the chat template would build {what} larger than {self.max_chars} characters")


def length(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def text_size(value: Any, budget: Budget) -> int:
    """About how many characters str(value) would have, counted without building it. A list may
    hold one large string many times over, so containers are walked; the walk stops once past
    the limit, so it costs at most about max_chars steps."""
    total, stack, seen = 0, [value], 0
    while stack and total <= budget.max_chars:
        item = stack.pop()
        seen += 1
        if seen % _TIME_CHECK_EVERY == 0:
            budget.check_time()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, Namespace):
            stack.append(object.__getattribute__(item, "_Namespace__attrs"))
        else:
            total += _SCALAR_CHARS
    return total


def check_texts(values: Any, budget: Budget, what: str, extra: int = 0) -> None:
    """The characters of str() of each value together, plus `extra`, within the limit."""
    total = extra
    for value in values:
        total += text_size(value, budget)
        budget.check_size(total, what)


def check_format(fmt: str, args: Any, budget: Budget) -> None:
    """'%999999999d' / '{:999999999}' allocate their width at once, and each field may repeat
    an argument ('{0}{0}{0}'): widths within the limit, fields x arguments too."""
    for width, precision in _FORMAT_WIDTHS.findall(fmt):
        for digits in (width, precision):
            if digits and (len(digits) > 9 or int(digits) > budget.max_chars):
                raise ChatTemplateError("the chat template formats with a width too large")
    fields = fmt.count("%") + fmt.count("{") + 1
    arg_chars = sum(text_size(a, budget) for a in args)
    budget.check_size(len(fmt) + fields * arg_chars, "a formatted string")


def _replaced_size(s: str, old: Any, new: Any) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(s)
    hits = len(s) + 1 if old == "" else s.count(old)
    return len(s) + hits * max(len(new) - len(old), 0)


def _indent_width(width: Any) -> int:
    return len(width) if isinstance(width, str) else width if isinstance(width, int) else 4


def check_filter(name: str, args: tuple, kwargs: dict, budget: Budget) -> None:
    """Before a filter runs: the size of what it would build, where that can outgrow its input."""
    value = args[0] if args else None
    if name == "join":
        items = list(value) if not isinstance(value, (str, dict)) else [value]
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        check_texts(items, budget, "a join", len(sep) * len(items) if isinstance(sep, str) else 0)
    elif name == "replace" and len(args) >= 3:
        s = args[0] if isinstance(args[0], str) else ""
        budget.check_size(_replaced_size(s, args[1], args[2]), "a replacement")
    elif name == "indent" and isinstance(value, str):
        width = _indent_width(args[1] if len(args) > 1 else kwargs.get("width", 4))
        budget.check_size(len(value) + (value.count("\n") + 1) * width, "an indented string")
    elif name == "wordwrap" and isinstance(value, str):
        wrap = kwargs.get("wrapstring", args[4] if len(args) > 4 else "\n")
        budget.check_size(len(value) * (1 + len(wrap or "\n")), "a wrapped string")
    elif name == "format" and isinstance(value, str):
        check_format(value, (*args[1:], *kwargs.values()), budget)
    elif name in ("tojson", "pprint", "string", "sum"):
        indent = kwargs.get("indent") if name == "tojson" else None
        budget.check_size(text_size(value, budget) * (1 + _indent_width(indent or 0)), f"a {name} result")


def check_method(method: Callable, args: tuple, budget: Budget) -> None:
    """Before a str method runs: replace, join, expandtabs and translate can multiply sizes."""
    s, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(s, str):
        return
    if name == "replace" and len(args) >= 2:
        budget.check_size(_replaced_size(s, args[0], args[1]), "a replacement")
    elif name == "join" and args:
        items = list(args[0]) if not isinstance(args[0], (str, dict)) else [args[0]]
        check_texts(items, budget, "a join", len(s) * len(items))
    elif name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else 8
        budget.check_size(len(s) + s.count("\t") * tab, "an expanded string")
    elif name == "translate" and args and isinstance(args[0], dict):
        widest = max((text_size(v, budget) for v in args[0].values()), default=1)
        budget.check_size(len(s) * max(widest, 1), "a translated string")


def compile_tracer(budget: Budget) -> Callable:
    """sys.settrace hook for compiling: a deadline check on every Python call of Jinja's lexer,
    parser and code generator (none of them loops long without calling a function). Generator
    frames are passed over: one resumed by the garbage collector to be closed would swallow the
    error, and Python unsets a trace function that raised."""
    def global_(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not frame.f_code.co_flags & _GENERATOR_FLAGS:
            budget.check_time("compile")
    return global_


def render_tracer(budget: Budget) -> Callable:
    """sys.settrace hook: per-line deadline checks inside the template's own frames only."""
    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            budget.check_time()
        return local

    def global_(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename == "<template>":
            return local
        return None
    return global_
