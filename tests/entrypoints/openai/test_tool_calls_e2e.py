"""Tool calling through a real server and the openai SDK. A random-weight model never
learned tools: `required` and named tool_choice still give valid calls, and stop, because the
structured-output grammar built from the tools' schemas enforces them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.entrypoints.openai.conftest import CHAT_TEMPLATE
from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK_OFF_TEMPLATE = CHAT_TEMPLATE.replace("assistant:", "assistant:<think>\n\n</think>\n\n")
THINK_ON_TEMPLATE = CHAT_TEMPLATE.replace("assistant:", "assistant:<think>\n")


@pytest.fixture(scope="module")
def client(tiny_qwen3_think, tmp_path_factory):
    # The template closes an empty think block (Qwen3's with thinking off): the reasoning is over before
    # the first token, so the tool-call grammars apply from it.
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
             "--trust-request-chat-template", "--chat-template", THINK_OFF_TEMPLATE)
    gen = serve_tiny(tiny_qwen3_think, tmp_path_factory, extra_args=flags)
    url = next(gen)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    gen.close()


def _check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_give_valid_calls(client, stream):
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        # One call per choice (parallel_tool_calls=False): a random model would otherwise append calls
        # until max_tokens.
        kwargs = dict(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=3,
                      max_tokens=200, n=2, parallel_tool_calls=False)
        if not stream:
            resp = client.chat.completions.create(**kwargs)
            for c in resp.choices:
                assert c.finish_reason == "tool_calls" and not c.message.content
                assert len(c.message.tool_calls) == 1
                _check_calls(c.message.tool_calls, names)
            continue
        calls: dict[tuple[int, int], dict] = {}
        finish = {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    entry = calls.setdefault((ch.index, d.index), {"name": None, "args": "", "id": None})
                    if d.function and d.function.name:
                        assert entry["name"] is None, "the name is sent once, first"
                        entry["name"], entry["id"] = d.function.name, d.id
                    if d.function and d.function.arguments:
                        assert entry["name"] is not None, "arguments before the name"
                        entry["args"] += d.function.arguments
                if ch.finish_reason:
                    finish[ch.index] = ch.finish_reason
        assert finish == {0: "tool_calls", 1: "tool_calls"}
        assert {k[0] for k in calls} == {0, 1}
        for entry in calls.values():
            assert entry["name"] in names and entry["id"]
            jsonschema.validate(json.loads(entry["args"]), SCHEMAS[entry["name"]])


def _parses(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def _streamed_calls(client, **kwargs) -> dict[int, tuple[str, list[tuple[str, str]]]]:
    """Per choice: (finish_reason, [(name, arguments)]), checking OpenAI's delta shape: a call's
    first delta has its id, type, name and arguments "", the later ones argument pieces only."""
    calls: dict[int, dict[int, list]] = {}
    finish = {}
    pieces = 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            assert not ch.delta.content
            for d in ch.delta.tool_calls or []:
                mine = calls.setdefault(ch.index, {})
                if d.id is not None:
                    assert d.index not in mine and d.type == "function" and d.function.arguments == ""
                    mine[d.index] = [d.function.name, ""]
                else:
                    assert d.function.name is None and d.index in mine
                    mine[d.index][1] += d.function.arguments
                    pieces += 1
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    n_calls = sum(len(m) for m in calls.values())
    assert pieces > 2 * n_calls, "arguments stream in pieces, not one delta per call"
    return {i: (finish[i], [tuple(calls.get(i, {})[k]) for k in sorted(calls.get(i, {}))]) for i in finish}


@pytest.mark.parametrize("max_tokens", [200, 70])
def test_required_streamed_equals_whole_also_when_cut(client, max_tokens):
    """Several calls per choice (parallel_tool_calls by default); streamed == non-streamed. Cut by
    max_tokens (finish_reason "length"), the complete calls are valid and an unfinished last one is
    kept as far as it was generated, as OpenAI's API does (the stream has sent it too)."""
    kwargs = dict(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", temperature=1.0, seed=4,
                  max_tokens=max_tokens, n=4)
    resp = client.chat.completions.create(**kwargs)
    streamed = _streamed_calls(client, **kwargs)
    cut_with_calls = 0
    for c in resp.choices:
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        assert c.message.content is None
        finish, s_calls = streamed[c.index]
        assert finish == c.finish_reason and s_calls == calls
        # only the last call of a cut choice may be unfinished
        complete = calls if c.finish_reason != "length" or not calls or _parses(calls[-1][1]) else calls[:-1]
        for name, args in complete:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
        if c.finish_reason == "length":
            cut_with_calls += bool(complete)
        else:
            assert c.finish_reason == "tool_calls" and 1 <= len(calls) <= 8
    if max_tokens == 70:
        assert cut_with_calls, "the limit should cut some choice after a complete call"


def test_named_tool_cut_short_keeps_the_call(client):
    kwargs = dict(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=4, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = client.chat.completions.create(**kwargs).choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.id and call.function.name == "get_weather" and call.function.arguments.startswith("{")
    assert _streamed_calls(client, **kwargs) == {0: ("length", [("get_weather", call.function.arguments)])}


def test_tool_choice_errors(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=MODEL, messages=MSGS, tool_choice="required")
    for params, needle in (({"type": "object", "properties": {"a": {"type": "foo"}}}, 'Unsupported type "foo"'),
                           ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
                            "uniqueItems")):
        bad = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            with pytest.raises(openai.BadRequestError, match=needle):
                client.chat.completions.create(model=MODEL, messages=MSGS, tools=bad, tool_choice=choice)


def test_auto_tool_choice_without_markup_is_plain_content(client):
    """The random model writes no <tool_call> markup: auto mode returns its text as content."""
    resp = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="auto",
                                          temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    c = resp.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls


def test_tool_history_renders_through_the_chat_template(client):
    """Assistant tool_calls and tool results in the history reach the template."""
    import httpx

    template = (
        "{% for m in messages %}{{ m['role'] }}:"
        "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}CALL {{ c['function']['name'] }}"
        "{{ c['function']['arguments'] }}{% endfor %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    )
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    base = str(client.base_url).removesuffix("/v1/")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": history, "chat_template": template,
                                            "add_generation_prompt": False}, headers=headers)
    assert r.status_code == 200, r.text
    d = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]}, headers=headers)
    text = d.json()["prompt"]
    assert 'assistant:CALL get_weather{"city": "Paris", "unit": "celsius"}' in text
    assert "tool:21 degrees" in text
    resp = client.chat.completions.create(model=MODEL, messages=history, max_tokens=3, temperature=0,
                                          extra_body={"chat_template": template})
    assert resp.usage.prompt_tokens == r.json()["count"]


def test_grammar_applies_after_the_reasoning(client, tiny_qwen3_think):
    """--reasoning-parser qwen3: a prompt that opens a think block leaves the model free until it
    closes it; the answer after `</think>` follows the grammar. A logit bias makes the random model
    close it at once: under the think-on template `</think>` is its first token and the answer is one
    of the choices; under the server's think-off template the grammar masks `</think>` from the start.
    (How the qwen3 text parser splits an output that does not open with `<think>` is its own matter:
    all content, test_reasoning_parsers.py.)"""
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(tiny_qwen3_think).convert_tokens_to_ids("</think>")
    choices = ["Paris", "Tokyo"]
    kwargs = dict(model=MODEL, messages=MSGS, temperature=0, max_tokens=20, logprobs=True,
                  logit_bias={str(end): 100})
    on = client.chat.completions.create(**kwargs, extra_body={"structured_outputs": {"choice": choices},
                                                              "chat_template": THINK_ON_TEMPLATE})
    c = on.choices[0]
    assert c.logprobs.content[0].token == "</think>" and c.finish_reason == "stop"
    assert c.message.content.removeprefix("</think>") in choices
    off = client.chat.completions.create(**kwargs, extra_body={"structured_outputs": {"choice": choices}})
    c = off.choices[0]
    assert all(t.token != "</think>" for t in c.logprobs.content)
    assert c.finish_reason == "stop" and c.message.content in choices
