"""Size limits on structured-output specs, checked before anything is parsed or compiled, and
the compile time limit.

Compiling a grammar against a vocabulary costs CPU that grows with the spec, faster than
linearly: a `choice` of 20k entries takes seconds, 100k minutes. So what is plainly too big is
refused up front, with the limit named (a 400 over HTTP, ValueError offline). What passes can
still be slow (many distinct bounded repetitions): the time limit covers that, enforced by
killing the compiling process (compile_pool.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm import envs
from pagedllm.sampling_params import StructuredOutputsParams

MAX_CHOICES = 2048  # entries of a `choice`
MAX_CHOICE_CHARS = 65536  # characters of all its entries together
MAX_REGEX_CHARS = 16384  # a `regex` spec
MAX_GRAMMAR_CHARS = 65536  # an EBNF `grammar` spec
MAX_SCHEMA_CHARS = 131072  # a JSON schema or structural tag, as JSON text
MAX_SCHEMA_NODES = 4096  # objects within a schema (subschemas, property schemas, ...)
MAX_PROPERTIES = 1024  # properties over the whole schema
MAX_ENUM_VALUES = 2048  # `enum` entries over the whole schema
MAX_PATTERN_CHARS = 4096  # one `pattern` (or `patternProperties` key) in a schema
MAX_REPEAT = 100_000  # minItems/maxItems/minLength/... and the n, m of `{n,m}` in a regex or EBNF

TIMEOUT_ENV = "PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT_S"  # seconds one compile may take, default 60
WORKERS_ENV = "PAGEDLLM_GRAMMAR_COMPILE_WORKERS"  # compiler processes per engine core, default 2

_REPEAT_KEYS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_QUANTIFIER = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")  # not an escaped `\{`
# Values, not schemas: their contents are not keywords.
_VALUE_KEYS = frozenset({"enum", "const", "default", "examples"})
# Maps from names to schemas: their keys are names, not keywords.
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def env_timeout_s() -> float:
    return _env_positive(TIMEOUT_ENV, 60.0, float)


def env_workers() -> int:
    return _env_positive(WORKERS_ENV, 2, int)


def _env_positive(name: str, default: float, kind: type) -> Any:
    raw = getattr(envs, name)
    try:
        value = kind(raw) if raw else default
    except ValueError:
        value = 0
    if not value > 0:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {raw!r}")
    return value


def check(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the first limit the spec exceeds."""
    if params.choice is not None:
        _at_most("choice", "entries", len(params.choice), MAX_CHOICES, "MAX_CHOICES")
        _at_most("choice", "characters", sum(len(c) for c in params.choice), MAX_CHOICE_CHARS, "MAX_CHOICE_CHARS")
    elif params.regex is not None:
        _check_text("regex", params.regex, MAX_REGEX_CHARS, "MAX_REGEX_CHARS")
    elif params.grammar is not None:
        _check_text("grammar", params.grammar, MAX_GRAMMAR_CHARS, "MAX_GRAMMAR_CHARS")
    elif params.json is not None:
        _check_json("json", params.json)
    elif params.structural_tag is not None:
        _check_json("structural_tag", params.structural_tag)


def _at_most(kind: str, what: str, value: int, limit: int, name: str) -> None:
    if value > limit:
        raise ValueError(f"structured_outputs.{kind} has {value} {what}, more than the limit of {limit} ({name})")


def _check_text(kind: str, text: Any, limit: int, name: str) -> None:
    if isinstance(text, str):
        _at_most(kind, "characters", len(text), limit, name)
        _check_quantifiers(kind, text)


def _check_quantifiers(where: str, text: str) -> None:
    for m in _QUANTIFIER.finditer(text):
        n = max(int(g) for g in m.groups() if g)
        if n > MAX_REPEAT:
            raise ValueError(f"structured_outputs.{where}: the repetition {m.group(0)} is more than the limit of "
                             f"{MAX_REPEAT} (MAX_REPEAT)")


def _check_json(kind: str, spec: Any) -> None:
    if isinstance(spec, str):
        _at_most(kind, "characters", len(spec), MAX_SCHEMA_CHARS, "MAX_SCHEMA_CHARS")
        try:
            spec = json.loads(spec)
        except (ValueError, RecursionError):
            return  # not JSON: the compiler's own check says so
    else:
        try:
            size = len(json.dumps(spec))
        except (TypeError, ValueError, RecursionError):
            size = 0  # not JSON: the compiler's own check says so
        _at_most(kind, "characters", size, MAX_SCHEMA_CHARS, "MAX_SCHEMA_CHARS")
    _SchemaCount(kind).walk(spec)


class _SchemaCount:
    """Counts over every object of a schema (or structural tag), iteratively: a deep schema
    must not exhaust the stack here."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.nodes = self.properties = self.enum_values = 0

    def walk(self, root: Any) -> None:
        stack = [(root, "#", False)]
        while stack:
            node, path, names = stack.pop()
            if isinstance(node, list):
                stack.extend((v, f"{path}/{i}", False) for i, v in enumerate(node))
            elif isinstance(node, dict) and names:
                stack.extend((v, f"{path}/{k}", False) for k, v in node.items())
            elif isinstance(node, dict):
                self._visit(node, path)
                stack.extend((v, f"{path}/{k}", k in _NAME_MAPS) for k, v in node.items() if k not in _VALUE_KEYS)

    def _visit(self, s: dict, path: str) -> None:
        kind = self.kind
        self.nodes += 1
        _at_most(kind, "schema objects", self.nodes, MAX_SCHEMA_NODES, "MAX_SCHEMA_NODES")
        if isinstance(s.get("properties"), dict):
            self.properties += len(s["properties"])
            _at_most(kind, "properties", self.properties, MAX_PROPERTIES, "MAX_PROPERTIES")
        if isinstance(s.get("enum"), list):
            self.enum_values += len(s["enum"])
            _at_most(kind, "enum values", self.enum_values, MAX_ENUM_VALUES, "MAX_ENUM_VALUES")
        for key in _REPEAT_KEYS:
            value = s.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_REPEAT:
                raise ValueError(f"structured_outputs.{kind}: {key} {value} at {path} is more than the limit of "
                                 f"{MAX_REPEAT} (MAX_REPEAT)")
        patterns = [s["pattern"]] if isinstance(s.get("pattern"), str) else []
        if isinstance(s.get("patternProperties"), dict):
            patterns += list(s["patternProperties"])
        if s.get("type") == "grammar" and isinstance(s.get("grammar"), str):  # a structural tag's EBNF
            _check_quantifiers(f"{kind} grammar at {path}", s["grammar"])
        for pattern in patterns:
            if len(pattern) > MAX_PATTERN_CHARS:
                raise ValueError(f"structured_outputs.{kind}: a pattern of {len(pattern)} characters at {path} is "
                                 f"more than the limit of {MAX_PATTERN_CHARS} (MAX_PATTERN_CHARS)")
            _check_quantifiers(f"{kind} pattern at {path}", pattern)
