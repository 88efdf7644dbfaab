"""Structured outputs through a real `pagedllm serve` process on the tiny random model, driven by
the official openai SDK: response_format (json_schema, json_object), the structured_outputs
object and the guided_* fields, streamed and not, n=3; bad specs are 400s with the compiler's
message."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny
from tests.structured_output.conftest import CHOICES, GRAMMAR, GRAMMAR_RE, REGEX, SCHEMA

MSGS = [{"role": "user", "content": "Describe a cat as JSON."}]
SAMPLE = dict(n=3, temperature=1.0, seed=11, max_tokens=150)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    # a tiny model: one thread is fastest, whatever else runs
    yield from serve_tiny(tiny_llama, tmp_path_factory, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def json_bias(tiny_llama) -> dict[str, float]:
    """JSON allows any whitespace between tokens and a random model likes it; steer it off so
    the object closes within max_tokens. (Steering only: the mask still decides what is valid.)"""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    return {str(i): -4.0 for i in range(len(tok))
            if i not in tok.all_special_ids and not tok.decode([i]).strip(" \t\r\n")}


def _chat(client, stream: bool, **kwargs) -> list[tuple[str, str]]:
    """(content, finish_reason) per choice, in index order, streamed or not."""
    if not stream:
        resp = client.chat.completions.create(model=MODEL, messages=MSGS, **SAMPLE, **kwargs)
        return [(c.message.content, c.finish_reason) for c in sorted(resp.choices, key=lambda c: c.index)]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=MSGS, stream=True, **SAMPLE, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return [(texts[i], reasons.get(i)) for i in sorted(texts)]


def _completion(client, stream: bool, extra_body: dict, prompt: str = "Hello, my name is") -> list[tuple[str, str]]:
    if not stream:
        resp = client.completions.create(model=MODEL, prompt=prompt, extra_body=extra_body, **SAMPLE)
        return [(c.text, c.finish_reason) for c in sorted(resp.choices, key=lambda c: c.index)]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, extra_body=extra_body, stream=True, **SAMPLE):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return [(texts[i], reasons.get(i)) for i in sorted(texts)]


def _all_stopped(results: list[tuple[str, str]]) -> list[str]:
    assert len(results) == 3
    assert [r for _, r in results] == ["stop"] * 3, results
    return [t for t, _ in results]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema(client, json_bias, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    for text in _all_stopped(_chat(client, stream, response_format=fmt, logit_bias=json_bias)):
        obj = json.loads(text)
        jsonschema.validate(obj, SCHEMA)
        assert list(obj) == list(SCHEMA["properties"])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_object(client, json_bias, tiny_llama, stream):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    bias = {**json_bias, **{str(tok.convert_tokens_to_ids(t)): 5.0 for t in ('"', "}")}, str(tok.eos_token_id): 5.0}
    texts = _all_stopped(_chat(client, stream, response_format={"type": "json_object"}, logit_bias=bias))
    assert all(isinstance(json.loads(t), dict) for t in texts), texts


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra_body, check", [
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_RE, t)),
    ({"structured_outputs": {"choice": ["left", "right", "up ↑"]}}, lambda t: t in ["left", "right", "up ↑"]),
    ({"structured_outputs": {"regex": r"[0-9]{3}-[A-Z]{2}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
], ids=["guided_regex", "guided_choice", "guided_grammar", "so_choice", "so_regex"])
def test_completions(client, extra_body, check, stream):
    texts = []
    for prompt in ("Hello, my name is", "The quick brown fox"):
        texts += _all_stopped(_completion(client, stream, extra_body, prompt))
    assert all(check(t) for t in texts), texts


def test_chat_guided_json_streamed_equals_non_streamed(client, json_bias):
    kw = dict(extra_body={"guided_json": SCHEMA}, logit_bias=json_bias)
    full = _chat(client, False, **kw)
    assert _chat(client, True, **kw) == full  # same seed: the same samples
    for text in _all_stopped(full):
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("kwargs, message", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     'Unsupported type "foo"'),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(ab"}}}}}),
     "parenthesis is not closed"),
    (dict(extra_body={"guided_json": '{"type": '}), "not valid JSON"),
    (dict(extra_body={"guided_regex": "(ab"}), "parenthesis is not closed"),
    (dict(extra_body={"structured_outputs": {"regex": "a{3,1}"}}), "Lower bound is larger than upper bound"),
    (dict(extra_body={"guided_grammar": "root ::= foo"}), 'Rule "foo" is not defined'),
    (dict(extra_body={"guided_grammar": 'start ::= "a"'}), 'root rule with name "root" is not found'),
    (dict(extra_body={"guided_choice": []}), "non-empty list of strings"),
    (dict(extra_body={"structured_outputs": {}}), "exactly one of"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}), "exactly one of"),
    (dict(extra_body={"structured_outputs": {"bogus": "a"}}), "bogus"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["a"]}), "only one structured-output constraint"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
     "only one structured-output constraint"),
    (dict(extra_body={"guided_json": {"type": "object"}, "structured_outputs": {"choice": ["a"]}}),
     "only one structured-output constraint"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}), "'uniqueItems' at # is not supported"),
    (dict(extra_body={"guided_json": {"type": "integer", "minimum": "zero"}}), "minimum must be a finite number"),
    (dict(extra_body={"guided_json": {"$ref": "#/$defs/missing"}}), "missing"),
    (dict(response_format={"type": "structural_tag"}), "needs a `format`"),
    (dict(response_format={"type": "structural_tag", "format": {"type": "nope"}}), "nope"),
    (dict(response_format={"type": "structural_tag", "structures": "x", "triggers": []}), "structures must be"),
    (dict(extra_body={"structured_outputs": {"unbounded": True}}), "needs a constraint"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_specs_are_400(client, kwargs, message, stream):
    with pytest.raises(openai.BadRequestError) as e:
        resp = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, stream=stream, **kwargs)
        list(resp) if stream else None
    assert e.value.status_code == 400
    body = e.value.body
    assert set(body) >= {"message", "type", "param", "code"} and body["code"] == 400, body
    assert body["type"] == "invalid_request_error", body
    assert message in body["message"], body


@pytest.mark.parametrize("stream", [False, True])
def test_chat_structural_tag(client, stream):
    """response_format structural_tag, xgrammar's shape: here a tag that must hold the JSON."""
    fmt = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<r>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</r>"}}
    for text in _all_stopped(_chat(client, stream, response_format=fmt)):
        assert text.startswith("<r>") and text.endswith("</r>"), text
        jsonschema.validate(json.loads(text[3:-4]), SCHEMA)


def test_bounded_json_needs_no_steering(client):
    """No logit bias: the bounded grammar alone ends the JSON; `unbounded` is accepted beside
    response_format (vLLM's options-only structured_outputs)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    for text in _all_stopped(_chat(client, False, response_format=fmt)):
        jsonschema.validate(json.loads(text), SCHEMA)
    resp = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, response_format=fmt,
                                          extra_body={"structured_outputs": {"unbounded": True}})
    assert resp.choices[0].message.content is not None


def test_server_still_serves_after_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "(("})
    resp = client.completions.create(model=MODEL, prompt="x", max_tokens=16, temperature=0,
                                     extra_body={"guided_choice": ["alpha", "beta"]})
    assert resp.choices[0].text in ("alpha", "beta") and resp.choices[0].finish_reason == "stop"
