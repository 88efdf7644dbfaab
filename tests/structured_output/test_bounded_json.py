"""JSON grammars are bounded by default: whitespace between tokens and the digits of numbers are
limited, for schemas, json_object, tools' schemas and structural tags, while valid compact and
pretty JSON still passes; `unbounded=True` gives xgrammar's own grammar back. Checked by walking
an xgrammar matcher over strings (no model), and on a tiny random model's samples."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
import xgrammar as xgr

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.grammar import JSON_MAX_DIGITS, JSON_MAX_INDENT, json_schema, recipe, validate

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
NESTED = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 20},
        "meta": {"type": "object", "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
            "score": {"type": "number"},
        }, "required": ["tags", "score"]},
    },
    "required": ["title", "meta"],
}


@pytest.fixture(scope="module")
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1)


def matcher(compiler, so: StructuredOutputsParams) -> xgr.GrammarMatcher:
    kind, args, kwargs = recipe(so)
    return xgr.GrammarMatcher(getattr(compiler, f"compile_{kind}")(*args, **kwargs))


def accepts(compiler, so: StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar takes `text` whole, as a complete output."""
    m = matcher(compiler, so)
    return m.accept_string(text) and m.is_completed()


def test_person_schema_accepts_compact_and_pretty(compiler):
    so = StructuredOutputsParams(json=PERSON)
    obj = {"name": "Ada Lovelace", "age": 36}
    for text in (json.dumps(obj), json.dumps(obj, separators=(",", ":")), json.dumps(obj, indent=2),
                 json.dumps(obj, indent=4), '{"name":"Ada","age":-7}', '{"name": "", "age": 0}'):
        assert accepts(compiler, so, text), text


def test_person_schema_refuses_runaway_whitespace_and_digits(compiler):
    so = StructuredOutputsParams(json=PERSON)
    digits = "9" * JSON_MAX_DIGITS
    assert accepts(compiler, so, f'{{"name": "A", "age": {digits}}}')
    assert accepts(compiler, so, f'{{"name": "A", "age": -{digits}}}')
    assert not accepts(compiler, so, f'{{"name": "A", "age": 1{digits}}}')
    assert not accepts(compiler, so, '{"name": "A", "age": ' + "1" * 30 + "}")
    indent = "\n" + " " * JSON_MAX_INDENT
    assert accepts(compiler, so, "{" + indent + '"name": "A", "age": 1' + indent + "}")
    assert not accepts(compiler, so, "{" + indent + ' "name": "A", "age": 1}')
    assert not accepts(compiler, so, '{  "name": "A", "age": 1}')
    assert not accepts(compiler, so, "{\n    \n    \n    \n" + '"name": "A", "age": 1}')
    assert not accepts(compiler, so, '{"name": "A", "age": 1}\n')
    # the issue's two failures, as prefixes the grammar must refuse
    assert not matcher(compiler, so).accept_string("{\n" + " " * 40)
    assert not matcher(compiler, so).accept_string("{\n\n")
    assert not matcher(compiler, so).accept_string('{"name": "A", "age": 18000000000000000000')


def test_unbounded_restores_xgrammar_behaviour(compiler):
    so = StructuredOutputsParams(json=PERSON, unbounded=True)
    assert accepts(compiler, so, '{"name": "A", "age": ' + "1" * 30 + "}")
    assert accepts(compiler, so, "{" + "\n" * 40 + '"name": "A", "age": 1}')
    obj = StructuredOutputsParams(json_object=True, unbounded=True)
    assert accepts(compiler, obj, '{"a": ' + "1" * 30 + ', "b": 1e99}')


def test_schema_bounds_win_over_the_default(compiler):
    big = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 10**18}},
           "required": ["n"]}
    so = StructuredOutputsParams(json=big)
    assert accepts(compiler, so, '{"n": ' + "9" * 18 + "}")
    assert not accepts(compiler, so, '{"n": -1}')
    only_min = {"type": "integer", "minimum": 5}
    assert accepts(compiler, StructuredOutputsParams(json=only_min), "9" * JSON_MAX_DIGITS)
    assert not accepts(compiler, StructuredOutputsParams(json=only_min), "4")
    assert not accepts(compiler, StructuredOutputsParams(json=only_min), "1" * 30)


def test_numbers_are_bounded(compiler):
    so = StructuredOutputsParams(json={"type": "array", "items": {"type": "number"}, "maxItems": 4})
    assert accepts(compiler, so, "[1, -2.5, 0.125, 123456789012345.5]")
    assert not accepts(compiler, so, "[1234567890123456]")
    assert not accepts(compiler, so, "[1.1234567]")  # at most 6 digits after the point


def test_nested_schema_and_any_values(compiler):
    so = StructuredOutputsParams(json=NESTED)
    good = {"title": "x", "meta": {"tags": ["a", "b", "c"], "score": 2.5}}
    assert accepts(compiler, so, json.dumps(good, indent=2))
    assert not accepts(compiler, so, json.dumps({"title": "x", "meta": {"tags": ["a"] * 4, "score": 1}}))
    # `{}` and an object without properties allow any value, bounded the same way
    loose = {"type": "object", "properties": {"extra": {}, "bag": {"type": "object"}}, "required": ["extra", "bag"]}
    so = StructuredOutputsParams(json=loose)
    assert accepts(compiler, so, '{"extra": [1, {"k": null}], "bag": {"x": "y", "z": [true]}}')
    assert not accepts(compiler, so, '{"extra": ' + "1" * 20 + ', "bag": {}}')
    assert not accepts(compiler, so, '{"extra": 1, "bag": {"x": ' + "1" * 20 + "}}")


def test_json_object_is_bounded(compiler):
    so = StructuredOutputsParams(json_object=True)
    for text in ("{}", '{"a": 1}', '{"a": {"b": [1, 2.5, "x", null, true, false]}, "c": -3}',
                 json.dumps({"deep": {"er": {"list": [1, [2, [3]]]}}}, indent=2)):
        assert accepts(compiler, so, text), text
    assert not accepts(compiler, so, "[1]")
    assert not accepts(compiler, so, '{"a": 1' + "0" * 20 + "}")
    assert not accepts(compiler, so, '{"a":\n\n1}')
    compact = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    assert accepts(compiler, compact, '{"a":[1,2]}')
    assert not accepts(compiler, compact, '{"a": 1}')


def test_strings_with_length_bounds_refuse_control_characters(compiler):
    """xgrammar lets a raw tab into a string with maxLength; JSON does not."""
    for so in (StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)):
        assert not accepts(compiler, so, '{"name":"A\tB","age":1}')
        assert accepts(compiler, so, '{"name":"A B","age":1}')


def test_disable_any_whitespace_still_bounds_digits(compiler):
    so = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    assert accepts(compiler, so, '{"name":"A","age":3}')
    assert not accepts(compiler, so, '{"name": "A", "age": 3}')
    assert not accepts(compiler, so, '{"name":"A","age":' + "1" * 30 + "}")


def test_tool_schemas_are_bounded(compiler):
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.chat_tools import tool_constraint

    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
    for parallel, most in ((False, 1), (None, 8)):
        req = SimpleNamespace(tools=tools, parallel_tool_calls=parallel)
        so = tool_constraint(req, "required", None)
        call = '{"name":"add","parameters":{"a":1,"b":2.5}}'
        assert accepts(compiler, so, "[" + ",".join([call] * most) + "]")
        assert not accepts(compiler, so, "[" + ",".join([call] * (most + 1)) + "]")
        assert not accepts(compiler, so, "[]")
        assert not accepts(compiler, so, '[{"name":"add","parameters":{"a":' + "1" * 20 + ',"b":1}}]')
    named = tool_constraint(SimpleNamespace(tools=tools, parallel_tool_calls=None), "named", "add")
    assert accepts(compiler, named, '{"a":1,"b":-0.5}')
    assert not accepts(compiler, named, '{"a":' + "1" * 20 + ',"b":1}')


def test_guided_json_string_spec_is_bounded(compiler):
    so = StructuredOutputsParams(json=json.dumps(PERSON))
    assert accepts(compiler, so, '{"name": "A", "age": 1}')
    assert not accepts(compiler, so, '{"name": "A", "age": ' + "1" * 30 + "}")


def test_rewrite_leaves_the_callers_schema_alone():
    schema = copy.deepcopy(NESTED)
    out = json.loads(json_schema(schema))
    assert schema == NESTED
    assert out["properties"]["meta"]["properties"]["score"]["maximum"] == 10**JSON_MAX_DIGITS - 1
    assert list(out["properties"]) == list(NESTED["properties"])


@pytest.mark.parametrize("schema, message", [
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' at #/properties/a"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "'if'"),
    ({"type": "array", "contains": {"const": 1}}, "'contains'"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
    ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, "allOf"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "minLength/maxLength together with pattern"),
    ({"type": "integer", "minimum": "zero"}, "minimum must be a finite number"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}, "nope"),
])
def test_unsupported_or_invalid_schema_is_a_value_error(schema, message):
    with pytest.raises(ValueError, match="structured_outputs.json") as e:
        validate(StructuredOutputsParams(json=schema))
    assert message in str(e.value)


def test_structural_tags_both_shapes(compiler):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    legacy = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
              "triggers": ["<f>"]}
    current = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f"], "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": schema},
                  "end": "</f>"}]}}
    for tag in (legacy, json.dumps(current)):
        so = StructuredOutputsParams(structural_tag=tag)
        validate(so)
        assert accepts(compiler, so, 'Sure. <f>{"x": 12}</f>')
        assert accepts(compiler, so, "no call at all")
        assert not accepts(compiler, so, '<f>{"x": "no"}</f>')
        assert not accepts(compiler, so, '<f>{"x": ' + "1" * 20 + "}</f>")
    assert accepts(compiler, StructuredOutputsParams(structural_tag=legacy), '<f>{"x": 1}</f> and <f>{"x": 2}</f>')
    assert not accepts(compiler, StructuredOutputsParams(structural_tag=current), '<f>{"x": 1}</f> more')


@pytest.mark.parametrize("tag, message", [
    ({"type": "structural_tag"}, "needs a `format`"),
    ({"type": "structural_tag", "format": {"type": "nope"}}, "nope"),
    ("{", "not valid JSON"),
    ({"type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>"}], "triggers": "<a>"},
     "triggers must be a list"),
])
def test_bad_structural_tags(tag, message):
    with pytest.raises(ValueError, match="structured_outputs.structural_tag") as e:
        validate(StructuredOutputsParams(structural_tag=tag))
    assert message in str(e.value)


def test_sampled_outputs_finish_without_steering(tiny_llama):
    """A random model with no logit bias against whitespace: the bounded grammar alone makes it
    finish, and every sample validates."""
    import torch

    from pagedllm import LLM

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24)
        schema = {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
            "score": {"type": "number"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        }, "required": ["name", "age", "score", "tags"], "additionalProperties": False}
        params = SamplingParams(n=4, temperature=1.0, seed=21, max_tokens=200,
                                structured_outputs=StructuredOutputsParams(json=schema))
        outs = llm.generate(["Hello, my name is", "A JSON record:"], params, use_tqdm=False)
        for c in (c for o in outs for c in o.outputs):
            assert c.finish_reason == "stop", c
            obj = json.loads(c.text)
            jsonschema.validate(obj, schema)
            assert abs(obj["age"]) < 10**JSON_MAX_DIGITS
    finally:
        torch.set_num_threads(before)
