"""Chat-template rendering with limits: Jinja's ImmutableSandboxedEnvironment, plus a time
limit, an output-size limit and size checks on the operations that can build a huge value
in one C call (`"a" * 10**10`, `x|center(10**9)`, `"%999999999d" % 1`).

Templates are code. A model's own template, or one an operator passes with
--chat-template, is trusted to be correct but not to be cheap on every input; a template
sent in a request is untrusted. Both render here, with the same variables transformers'
`apply_chat_template` gives them (messages, tools, documents, add_generation_prompt, the
tokenizer's special tokens, raise_exception, strftime_now), so the text is the same.

The time limit is enforced by a line tracer on the template's compiled frames only, so a
loop with an empty body is stopped as surely as one that calls functions; it runs in the
thread that renders (the server renders in a worker thread, never on its event loop)."""

from __future__ import annotations

import functools
import json
import sys
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

from pagedllm.entrypoints.template_limits import (
    Budget,
    ChatTemplateError,
    check_filter,
    check_format,
    check_method,
    check_texts,
    compile_tracer,
    length,
    render_tracer,
    text_size,
)

RENDER_TIMEOUT_S = 5.0
MAX_RENDER_CHARS = 16 * 1024 * 1024
MAX_RANGE = 100_000
# Source characters of a template sent in a request; real chat templates are under ~20 KB, and
# compiling costs about a second per 64 KB (and memory in the compiled-template cache).
MAX_TEMPLATE_CHARS = 64 * 1024
MAX_INT_BITS = 64 * 1024
# Brackets inside one expression, and blocks ({% if %}, {% for %}, ...) inside each other: Jinja's
# parser and Python's compiler recurse per level (and allow 20 nested loops); models' templates nest
# fewer than 8.
MAX_TEMPLATE_NESTING = 16
_TEMPLATE_FILENAME = "<pagedllm chat template>"
_CONTINUE_TAG = "PAGEDLLM_CONTINUE_FINAL_MESSAGE_TAG "


class TemplateRejectedError(ChatTemplateError):
    """The template itself raised (raise_exception, a Jinja error): the conversation may fit
    it once reshaped (chat_turns.py), unlike a template that ran past a limit."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask templates): the body only."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _TemplateNamespace(Namespace):
    """namespace() that refuses underscore names (no reach into Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_public(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_public(name)
        Namespace.__setitem__(self, name, value)


def _check_public(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"chat templates may not use underscore names on a namespace: {name!r}")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson: no HTML escaping, json.dumps' options."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _BoundedCodeGenerator(CodeGenerator):
    """`a ~ b` compiles to environment.concat, size-checked, instead of Jinja's unchecked str_join."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every value-building operation checked against the active budget
    before it builds its value (template_limits.py)."""

    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])
    code_generator_class = _BoundedCodeGenerator

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols],
                         finalize=self._finalize_output)
        self.filters["tojson"] = _tojson
        for name, fn in list(self.filters.items()):
            self.filters[name] = self._bounded(name, fn)
        self.globals.update(
            raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_TemplateNamespace,
            dict=_make_dict, range=self._range,
        )

    def _limits(self) -> Budget:
        budget = getattr(_ACTIVE, "budget", None)
        if budget is None:
            raise ChatTemplateError("chat templates render only through render_template")
        return budget

    def _check_args(self, args: tuple, kwargs: dict) -> None:
        budget = self._limits()
        budget.check_time()
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > budget.max_chars:
                raise ChatTemplateError(f"the chat template passed a number too large ({value})")

    def _finalize_output(self, value: Any) -> Any:
        """`{{ x }}`: str(x) of a list holding one string many times is checked before it is built."""
        budget = getattr(_ACTIVE, "budget", None)  # None: a constant folded at compile time
        if budget is not None and not isinstance(value, str):
            budget.check_size(text_size(value, budget), "an output value")
        return value

    def concat(self, values: tuple) -> str:
        check_texts(values, self._limits(), "a concatenation (~)")
        return "".join(map(str, values))

    def _bounded(self, name: str, fn: Callable) -> Callable:
        """A filter whose arguments, would-be result size and result are checked (center(10**9), join, ...)."""
        @functools.wraps(fn)
        def filter_(*args: Any, **kwargs: Any) -> Any:
            self._check_args(args[1:], kwargs)
            values = args[1:] if getattr(fn, "jinja_pass_arg", None) else args  # eval_ctx / context first
            if name in ("join", "sum") and values and not isinstance(values[0], (str, list, tuple, dict)):
                values = (list(values[0]), *values[1:])  # an iterator, walked once for the check
                args = args[:len(args) - len(values)] + values
            check_filter(name, values, kwargs, self._limits())
            result = fn(*args, **kwargs)
            self._limits().check_size(length(result), "a filter result")
            return result
        return filter_

    def _range(self, *args: int) -> Any:
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise ChatTemplateError(f"range() of more than {MAX_RANGE} items in the chat template")
        return r

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = self._limits()
        budget.check_time()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(times, int) and length(seq):
                    budget.check_size(length(seq) * max(times, 0), "a repeated value")
            if _ints(left, right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise ChatTemplateError("the chat template computed a number too large")
        elif operator == "+":
            budget.check_size(length(left) + length(right), "a concatenation")
        elif operator == "**":
            if isinstance(left, (int, float)) and isinstance(right, (int, float)) and abs(right) > 64 and abs(left) > 1:
                raise ChatTemplateError("the chat template computed a power too large")
        elif operator == "%" and isinstance(left, str):
            args = right.values() if isinstance(right, dict) else right if isinstance(right, tuple) else (right,)
            check_format(left, args, budget)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (kwargs may be "self")
        __self._check_args(args, kwargs)
        if getattr(__obj, "__name__", "") == "join" and args and not isinstance(args[0], (str, list, tuple, dict)):
            args = (list(args[0]), *args[1:])
        check_method(__obj, args, __self._limits())
        result = ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
        __self._limits().check_size(length(result), "a call result")
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format / format_map, with the format string's widths and fields checked first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = str(value.__self__)

        def checked(*args: Any, **kwargs: Any) -> str:
            values = [*args, *kwargs.values()]
            if getattr(value, "__name__", "") == "format_map" and args and isinstance(args[0], dict):
                values = list(args[0].values())
            check_format(fmt, values, self._limits())
            return wrapped(*args, **kwargs)
        return checked

def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) for v in values)


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


_ENV = BoundedEnvironment()
_ACTIVE = threading.local()  # the budget of the render running in this thread


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    _check_nesting(source)
    try:
        return _ENV.from_string(source)
    except (RecursionError, SyntaxError, MemoryError) as e:  # e.g. a chain of thousands of `+`
        raise ChatTemplateError(f"the chat template does not compile: {type(e).__name__}: {e}") from None


_OPENING, _CLOSING = frozenset("([{"), frozenset(")]}")
_BLOCK_TAGS = frozenset({"if", "for", "macro", "call", "filter", "block", "with", "autoescape", "generation"})


def _check_nesting(source: str) -> None:
    """Refuse, before parsing, a template nested past MAX_TEMPLATE_NESTING: counted on Jinja's
    own tokens (its lexer does not recurse), since its parser would exhaust the stack first."""
    brackets = blocks = 0
    tag_start = False
    for _, kind, value in _ENV.lex(source):
        if kind == "whitespace":
            continue
        if kind == "operator" and value in _OPENING:
            brackets += 1
        elif kind == "operator" and value in _CLOSING:
            brackets -= 1
        elif tag_start and kind == "name" and value in _BLOCK_TAGS:
            blocks += 1
        elif tag_start and kind == "name" and value[3:] in _BLOCK_TAGS and value.startswith("end"):
            blocks -= 1
        if max(brackets, blocks) > MAX_TEMPLATE_NESTING:
            what = "brackets" if brackets > MAX_TEMPLATE_NESTING else "blocks"
            raise ChatTemplateError(f"the chat template nests {what} more than {MAX_TEMPLATE_NESTING} levels deep")
        tag_start = kind == "block_begin"


def _compile_within(source: str, budget: Budget) -> Any:
    """The cached compiled template, compiled under the render's deadline when not cached."""
    previous_trace = sys.gettrace()
    sys.settrace(compile_tracer(budget))
    try:
        template = _compile(source)
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None
    finally:
        sys.settrace(previous_trace)
    budget.check_time("compile")  # where the tracer's error was swallowed (and tracing unset)
    return template


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Templates read reasoning as `reasoning_content` (most) or `thinking` (gpt-oss)."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
        out.append({"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else m)
    return out


def render_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    variables: dict[str, Any] | None = None,
    timeout_s: float = RENDER_TIMEOUT_S,
    max_chars: int = MAX_RENDER_CHARS,
    max_source_chars: int | None = MAX_TEMPLATE_CHARS,
) -> str:
    """Render one conversation. Raises ChatTemplateError (a ValueError) for a template longer
    than `max_source_chars` (None: a trusted template, any length), or that does not compile,
    raises, or runs past `timeout_s` (compiling included) or writes more than `max_chars`."""
    if max_source_chars is not None and len(source) > max_source_chars:
        raise ChatTemplateError(f"the chat template is {len(source)} characters long, more than the limit of "
                                f"{max_source_chars}")
    messages = _alias_reasoning([dict(m) for m in messages])
    if continue_final_message:  # a tag marks where the final message ends, wherever the template puts it
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ChatTemplateError("continue_final_message needs a final message with text content")
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}
    budget = Budget(timeout_s, max_chars)
    template = _compile_within(source, budget)
    context = {**(variables or {}), "messages": messages, "add_generation_prompt": add_generation_prompt}
    context.setdefault("tools", None)
    context.setdefault("documents", None)
    parts: list[str] = []
    total = 0
    previous_trace = sys.gettrace()
    _ACTIVE.budget = budget
    sys.settrace(render_tracer(budget))
    try:
        for chunk in template.generate(**context):
            total += len(chunk)
            budget.check_size(total, "a prompt")
            parts.append(chunk)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise TemplateRejectedError(f"the chat template failed: {type(e).__name__}: {e}") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError,
            MemoryError) as e:
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous_trace)
        _ACTIVE.budget = None
    text = "".join(parts)
    if continue_final_message:
        cut = text.rfind(_CONTINUE_TAG.strip())
        if cut < 0:
            raise ChatTemplateError("continue_final_message: the chat template dropped the final message's text")
        # A template that trims the message also trimmed the tag's space: trim the text the same way.
        text = text[:cut] if text.startswith(_CONTINUE_TAG, cut) else text[:cut].rstrip()
    return text
