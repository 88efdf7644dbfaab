"""From a StructuredOutputsParams to an xgrammar grammar: validation without a tokenizer
(for the front end) and the recipe the engine core compiles against the model's vocabulary
(compile_pool.py). Specs past the size limits (limits.py) are refused before either.

JSON grammars are bounded by default, because a small model takes any way out a grammar
leaves it (blank lines without end, an integer that never stops):
- whitespace between two JSON tokens is nothing, one space, or a newline and at most
  JSON_MAX_INDENT spaces or tabs: compact and pretty-printed JSON pass, blank lines do not;
- a number has at most JSON_MAX_DIGITS digits before the point and 6 after it, no exponent,
  unless the schema's own minimum / maximum allow more.
The digit bounds are written into the schema (minimum and maximum on every number, a bounded
"any value" definition wherever the schema allows anything), so the output still validates
against the caller's schema. The whitespace rule replaces xgrammar's in the EBNF it generates.
`unbounded=True` compiles the spec as given: xgrammar's free whitespace and digits.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pagedllm.sampling_params import STRUCTURED_OUTPUT_KINDS, StructuredOutputsParams
from pagedllm.structured_output import limits

JSON_MAX_INDENT = 20
JSON_MAX_DIGITS = 15
# xgrammar's whitespace rules in its generated EBNF (`whitespace_3 ::= (([ \n\r\t]))`, used as
# `whitespace_3{0, _WS_MARK}`) are swapped for this one.
_WS_MARK = 8
_WS_RULE = re.compile(r"^(\w+) ::= \(\(\[ \\n\\r\\t\]\)\)$", re.M)
_WS_NAME = "pagedllm_json_ws"
_LENGTH_STRING_CHARS, _JSON_STRING_CHARS = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'
_WS_DEF = f'{_WS_NAME} ::= "" | " " | "\\n" [ \\t]{{0, {JSON_MAX_INDENT}}}'
_LIMIT = 10**JSON_MAX_DIGITS - 1
_INT64 = 2**63 - 1  # xgrammar's largest bound
_ANY = "pagedllm_json_value"
_ANY_REF = f"#/$defs/{_ANY}"
# A bounded JSON value of any type: what `{}`, `true`, an object without properties and an
# array without items allow (and what json_object's values are).
_ANY_SCHEMA = {"anyOf": [
    {"type": "null"}, {"type": "boolean"}, {"type": "string"},
    {"type": "number", "minimum": -_LIMIT, "maximum": _LIMIT},
    {"type": "array", "items": {"$ref": _ANY_REF}},
    {"type": "object", "additionalProperties": {"$ref": _ANY_REF}},
]}
# Keywords that only annotate: a schema made of these alone allows any value.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$schema", "$id", "$anchor"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("additionalProperties", "items", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
            "propertyNames")
# Assertions xgrammar does not enforce: output could break them, so they are refused.
_UNSUPPORTED = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "contains",
                "minContains", "maxContains")
_REGEX_SPECIAL = re.compile(r"[\\^$.|?*+()\[\]{}]")
_STRING_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                             "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})


def _choice_regex(choices: list[str]) -> str:
    """Only regex syntax is escaped: xgrammar warns (a log line per character) on escapes it
    does not know, such as re.escape's `\\ `."""
    return "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\g<0>", c) for c in choices) + ")"


def _load(spec: str | dict, what: str) -> Any:
    if not isinstance(spec, str):
        return spec
    try:
        return json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.{what} is not valid JSON: {e}") from None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class _SchemaWalk:
    """One pass over a schema: refuses keywords xgrammar would silently ignore and, with
    `bound`, adds the digit bounds and swaps unconstrained values for the bounded one."""

    def __init__(self, bound: bool) -> None:
        self.bound = bound
        self.any_used = False

    def any_ref(self) -> dict:
        self.any_used = True
        return {"$ref": _ANY_REF}

    def walk(self, s: Any, path: str) -> Any:
        if s is True and self.bound:
            return self.any_ref()
        if not isinstance(s, dict):
            return s
        if self.bound and set(s) <= _ANNOTATIONS:
            return self.any_ref()
        s = dict(s)
        for key in _UNSUPPORTED:
            if key in s:
                raise ValueError(f"JSON schema keyword {key!r} at {path} is not supported (the grammar cannot "
                                 "enforce it)")
        if s.get("uniqueItems") is True:
            raise ValueError(f"JSON schema keyword 'uniqueItems' at {path} is not supported (the grammar cannot "
                             "enforce it)")
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if key in s and not _is_number(s[key]) and not (key.startswith("exclusive") and isinstance(s[key], bool)):
                raise ValueError(f"JSON schema at {path}: {key} must be a finite number, got {s[key]!r}")
        if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
            raise ValueError(f"JSON schema 'allOf' with more than one schema at {path} is not supported")
        if ("pattern" in s or s.get("format") in _STRING_FORMATS) and ("minLength" in s or "maxLength" in s):
            raise ValueError(f"JSON schema at {path}: minLength/maxLength together with pattern or format is not "
                             "supported")
        for key in _SCHEMA_MAPS:
            if isinstance(s.get(key), dict):
                s[key] = {k: self.walk(v, f"{path}/{key}/{k}") for k, v in s[key].items()}
        for key in _SCHEMA_LISTS:
            if isinstance(s.get(key), list):
                s[key] = [self.walk(v, f"{path}/{key}/{i}") for i, v in enumerate(s[key])]
        for key in _SCHEMAS:
            if isinstance(s.get(key), list):  # draft 4's tuple `items`
                s[key] = [self.walk(v, f"{path}/{key}/{i}") for i, v in enumerate(s[key])]
            elif key in s:
                s[key] = self.walk(s[key], f"{path}/{key}")
        if self.bound:
            self._bound(s)
        return s

    def _bound(self, s: dict) -> None:
        types = s.get("type")
        types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
        if types & {"integer", "number"}:
            lo = [s[k] for k in ("minimum", "exclusiveMinimum") if _is_number(s.get(k))]
            hi = [s[k] for k in ("maximum", "exclusiveMaximum") if _is_number(s.get(k))]
            if not lo:
                s["minimum"] = -_LIMIT if not hi or min(hi) >= -_LIMIT else max(min(hi) - _LIMIT, -_INT64)
            if not hi:
                s["maximum"] = _LIMIT if not lo or max(lo) <= _LIMIT else min(max(lo) + _LIMIT, _INT64)
        if "object" in types and not any(k in s for k in ("properties", "additionalProperties", "patternProperties")):
            s["additionalProperties"] = self.any_ref()
        if "array" in types and "items" not in s and "prefixItems" not in s:
            s["items"] = self.any_ref()


def json_schema(schema: Any, bound: bool = True) -> str:
    """The schema xgrammar compiles, as a JSON string; ValueError if it uses what xgrammar
    cannot enforce."""
    walk = _SchemaWalk(bound)
    try:
        out = walk.walk(schema, "#")
    except RecursionError:
        raise ValueError("the JSON schema is nested too deeply") from None
    if walk.any_used:
        if not isinstance(out, dict):
            out = {"$ref": _ANY_REF}
        defs = out.get("$defs", {})
        if isinstance(defs, dict):
            out["$defs"] = {**defs, _ANY: _ANY_SCHEMA}
    try:
        return json.dumps(out, allow_nan=False)
    except ValueError:
        raise ValueError("the JSON schema holds a non-finite number") from None


def json_object_schema(bound: bool = True) -> str:
    """json_object: any object, as vLLM (the builtin JSON grammar would also allow a top-level array)."""
    return json_schema({"type": "object"}, bound)


def _structural_tag(spec: str | dict, bound: bool) -> str:
    """vLLM's two shapes: {"type": "structural_tag", "format": {...}} (xgrammar's), and the older
    {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, rewritten to the first.
    Their JSON schemas are bounded as any other."""
    tag = _load(spec, "structural_tag")
    if not isinstance(tag, dict):
        raise ValueError("structured_outputs.structural_tag must be an object")
    if "structures" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
            raise ValueError("structural_tag.structures must be a list of {begin, schema, end}")
        if not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers):
            raise ValueError("structural_tag.triggers must be a list of strings")
        tags = [{"type": "tag", "begin": s.get("begin"), "end": s.get("end"),
                 "content": {"type": "json_schema", "json_schema": s.get("schema", True)}} for s in structures]
        fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags,
               "at_least_one": bool(tag.get("at_least_one", False)), "stop_after_first": False}
        tag = {"type": "structural_tag", "format": fmt}
    elif "format" not in tag:
        raise ValueError("structural_tag needs a `format` (or the older `structures` and `triggers`)")
    tag = {**tag, "type": "structural_tag", "format": _bound_formats(tag["format"], bound)}
    return json.dumps(tag, allow_nan=False)


def _bound_formats(fmt: Any, bound: bool) -> Any:
    if isinstance(fmt, list):
        return [_bound_formats(f, bound) for f in fmt]
    if not isinstance(fmt, dict):
        return fmt
    out = {k: _bound_formats(v, bound) for k, v in fmt.items() if k != "json_schema"}
    if "json_schema" in fmt:
        out["json_schema"] = fmt["json_schema"]
        if fmt.get("type") == "json_schema":
            out["json_schema"] = json.loads(json_schema(fmt["json_schema"], bound))
            if bound:
                out.setdefault("max_whitespace_cnt", _WS_MARK)
    return out


def recipe(params: StructuredOutputsParams) -> tuple[str, tuple, dict]:
    """(kind, args, kwargs) of the xgrammar call: kind is json_schema, regex, grammar or
    structural_tag (Grammar.from_<kind> / GrammarCompiler.compile_<kind>). ValueError for a
    spec past the size limits (limits.py), before any parsing."""
    import xgrammar as xgr

    limits.check(params)
    kind, spec = params.key()
    bound = not params.unbounded
    if kind in ("json", "json_object"):
        schema = json_schema(_load(spec, "json"), bound) if kind == "json" else json_object_schema(bound)
        compact = {"any_whitespace": False, "separators": (",", ":")} if params.disable_any_whitespace else {}
        if not bound:
            return "json_schema", (schema,), compact
        grammar = xgr.Grammar.from_json_schema(schema, **(compact or {"max_whitespace_cnt": _WS_MARK}))
        return "grammar", (bounded_ebnf(str(grammar)),), {}
    if kind == "regex":
        return "regex", (spec,), {}
    if kind == "choice":
        return "regex", (_choice_regex(params.choice),), {}
    if kind == "structural_tag":
        tag = _structural_tag(spec, bound)
        if not bound:
            return "structural_tag", (tag,), {}
        return "grammar", (bounded_ebnf(str(xgr.Grammar.from_structural_tag(tag))),), {}
    return "grammar", (spec,), {}


def bounded_ebnf(ebnf: str) -> str:
    """Two changes to the EBNF xgrammar generates for JSON: its whitespace (any run, here at
    most _WS_MARK long) becomes _WS_DEF, and the characters of a string with minLength /
    maxLength exclude control characters (xgrammar lets a raw tab through, which is not JSON)."""
    ebnf = ebnf.replace(_LENGTH_STRING_CHARS, _JSON_STRING_CHARS)
    names = _WS_RULE.findall(ebnf)
    if not names:
        return ebnf
    uses = re.compile(r"\b(?:" + "|".join(map(re.escape, names)) + r")\{0, " + str(_WS_MARK) + r"\}")
    return uses.sub(_WS_NAME, ebnf) + "\n" + _WS_DEF + "\n"


def validate(params: StructuredOutputsParams) -> None:
    """Raise ValueError with the compiler's message if the spec cannot become a grammar.
    Cheap (no vocabulary involved), so the front end can answer 400 before scheduling."""
    import xgrammar as xgr

    kind = kind_of(params)
    try:
        what, args, kwargs = recipe(params)
        build = {"json_schema": xgr.Grammar.from_json_schema, "regex": xgr.Grammar.from_regex,
                 "grammar": xgr.Grammar.from_ebnf, "structural_tag": xgr.Grammar.from_structural_tag}[what]
        build(*args, **kwargs)
    except Exception as e:  # ours are ValueErrors, xgrammar's parse errors RuntimeErrors
        raise ValueError(message(kind, e)) from None


def kind_of(params: StructuredOutputsParams) -> str:
    return next((k for k in STRUCTURED_OUTPUT_KINDS if getattr(params, k) not in (None, False)), "json")


def message(kind: str, e: Exception) -> str:
    msg = clean_message(str(e).strip() or type(e).__name__)
    return msg if msg.startswith("structured_outputs.") else f"invalid structured_outputs.{kind}: {msg}"


def clean_message(msg: str) -> str:
    """xgrammar's message, first line only, without its '[time] file:line:' prefix."""
    msg = msg.strip().splitlines()[0] if msg.strip() else msg
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", msg)

