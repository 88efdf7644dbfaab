"""Size limits on structured-output specs (structured_output/limits.py): each one refuses a spec
past it with a ValueError naming the limit, before anything is parsed or compiled; specs at the
limit pass. Over HTTP the same specs are 400s: test_grammar_compile_server.py."""

from __future__ import annotations

import time

import pytest

from pagedllm import SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import limits
from pagedllm.structured_output.grammar import validate
from tests.structured_output.conftest import PROMPTS
from tests.utils import assert_idle

BIG = 10**9


def _props(n: int, prefix: str = "p") -> dict:
    return {f"{prefix}{i}": {"type": "integer"} for i in range(n)}


# (spec, the limit's name): the first spec past each limit.
OVER_LIMITS = [
    (dict(choice=[str(i) for i in range(limits.MAX_CHOICES + 1)]), "MAX_CHOICES"),
    (dict(choice=["x" * (limits.MAX_CHOICE_CHARS // 2), "y" * (limits.MAX_CHOICE_CHARS // 2 + 1)]),
     "MAX_CHOICE_CHARS"),
    (dict(regex="a" * (limits.MAX_REGEX_CHARS + 1)), "MAX_REGEX_CHARS"),
    (dict(regex=f"[a-z]{{1,{BIG}}}"), "MAX_REPEAT"),
    (dict(regex=f"(ab){{{BIG}}}"), "MAX_REPEAT"),
    (dict(grammar='root ::= "a"\n' + "# " * limits.MAX_GRAMMAR_CHARS), "MAX_GRAMMAR_CHARS"),
    (dict(grammar=f"root ::= [a-z]{{0,{BIG}}}"), "MAX_REPEAT"),
    (dict(json={"type": "string", "description": "x" * limits.MAX_SCHEMA_CHARS}), "MAX_SCHEMA_CHARS"),
    (dict(json='{"type": "string", "description": "' + "x" * limits.MAX_SCHEMA_CHARS + '"}'), "MAX_SCHEMA_CHARS"),
    (dict(json={"type": "object", "properties": _props(limits.MAX_PROPERTIES + 1)}), "MAX_PROPERTIES"),
    (dict(json={"type": "object", "properties": {  # counted over the whole schema
        "a": {"type": "object", "properties": _props(limits.MAX_PROPERTIES // 2 + 1)},
        "b": {"type": "object", "properties": _props(limits.MAX_PROPERTIES // 2)}}}), "MAX_PROPERTIES"),
    (dict(json={"enum": list(range(limits.MAX_ENUM_VALUES + 1))}), "MAX_ENUM_VALUES"),
    (dict(json={"anyOf": [{"type": "null"}] * limits.MAX_SCHEMA_NODES}),
     "MAX_SCHEMA_NODES"),
    (dict(json={"type": "string", "pattern": "a" * (limits.MAX_PATTERN_CHARS + 1)}), "MAX_PATTERN_CHARS"),
    (dict(json={"type": "string", "pattern": f"^a{{2,{BIG}}}$"}), "MAX_REPEAT"),
    (dict(json={"type": "object", "patternProperties": {"b" * (limits.MAX_PATTERN_CHARS + 1): {}}}),
     "MAX_PATTERN_CHARS"),
    *[(dict(json={"type": t, key: BIG}), "MAX_REPEAT") for t, key in [
        ("array", "minItems"), ("array", "maxItems"), ("string", "minLength"), ("string", "maxLength"),
        ("object", "minProperties"), ("object", "maxProperties")]],
    # a property named like a keyword is still a schema
    (dict(json={"type": "object", "properties": {"default": {"type": "string", "maxLength": BIG}}}), "MAX_REPEAT"),
    (dict(json={"$defs": {"s": {"type": "string", "minLength": BIG}}, "$ref": "#/$defs/s"}), "MAX_REPEAT"),
    (dict(structural_tag={"type": "structural_tag", "format": {
        "type": "tag", "begin": "<a>", "end": "</a>",
        "content": {"type": "json_schema", "json_schema": {"type": "array", "maxItems": BIG}}}}), "MAX_REPEAT"),
    (dict(structural_tag={"structures": [{"begin": "<a>", "end": "</a>", "schema": {
        "type": "object", "properties": _props(limits.MAX_PROPERTIES + 1)}}], "triggers": ["<a>"]}),
     "MAX_PROPERTIES"),
]


@pytest.mark.parametrize("spec, name", OVER_LIMITS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(OVER_LIMITS)])
def test_over_a_limit_is_refused_before_parsing(spec, name):
    kind = next(iter(spec))
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{kind}.*limit of \d+ \({name}\)"):
        validate(StructuredOutputsParams(**spec))
    assert time.monotonic() - start < 1.0  # refused, not parsed


@pytest.mark.parametrize("spec", [
    dict(choice=[str(i) for i in range(limits.MAX_CHOICES)]),
    dict(json={"type": "object", "properties": _props(limits.MAX_PROPERTIES)}),
    dict(json={"enum": list(range(limits.MAX_ENUM_VALUES))}),
    dict(json={"type": "array", "items": {"type": "integer"}, "maxItems": limits.MAX_REPEAT}),
    dict(json={"type": "string", "maxLength": 65535}),
    dict(regex=f"[a-z]{{1,{limits.MAX_REPEAT}}}"),
    # values are not keywords: a default or an enum entry that looks like one is not counted
    dict(json={"type": "object", "default": {"maxLength": BIG}, "additionalProperties": False}),
    dict(json={"enum": [{"minItems": BIG}, "a"]}),
    dict(grammar='root ::= "{" [a-z]{0,5} "}"'),
    dict(regex=r"\{1000000000\}"),
], ids=["choices", "properties", "enum", "maxItems", "maxLength", "regex", "default", "enum-values", "ebnf-literal",
        "escaped-brace"])
def test_at_the_limit_passes(spec):
    validate(StructuredOutputsParams(**spec))


def test_choice_with_regex_syntax_is_matched_literally(llama):
    """Choices are escaped for xgrammar's regex without escapes it does not know (re.escape's
    `\\ ` logs a warning per space)."""
    choices = ["a b", "x.y*z", "(p)|[q]{2}", "back\\slash", "café ✓"]
    out = llama.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=20,
                                                    structured_outputs=StructuredOutputsParams(choice=choices)),
                         use_tqdm=False)[0]
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs), out.outputs


def test_over_a_limit_fails_at_generate(llama):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    too_many = StructuredOutputsParams(choice=[str(i) for i in range(limits.MAX_CHOICES + 1)])
    with pytest.raises(ValueError, match="MAX_CHOICES"):
        llama.generate(PROMPTS, [good, SamplingParams(structured_outputs=too_many)], use_tqdm=False)
    assert_idle(llama)
