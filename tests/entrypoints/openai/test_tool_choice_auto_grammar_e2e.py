"""`pagedllm serve --tool-choice-auto-grammar` on a tiny random model whose vocabulary has a
`<tool_call>` token: a logit bias on it stands in for a model that decides to call a tool; from
there the grammar makes the call valid and ends the output. Driven by the openai SDK, LangChain's
`bind_tools` and openai-agents' chat-completions model, which send `tools` without a
`tool_choice` (OpenAI's default, "auto")."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest

from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny
from tests.utils import build_tokenizer, tiny_config

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 5}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> tuple[str, int]:
    """A tiny llama whose tokenizer has `<tool_call>` as one (ordinary) token, and that token's id."""
    import torch
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("tool_llama"))
    tok = build_tokenizer(path)
    tok.add_tokens(["<tool_call>"])
    tok.save_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", len(tok)), dtype=torch.float32)
    model.save_pretrained(path)
    return path, tok.convert_tokens_to_ids("<tool_call>")


@pytest.fixture(scope="module")
def server(tool_model, tmp_path_factory):
    yield from serve_tiny(tool_model[0], tmp_path_factory, extra_args=("--tool-choice-auto-grammar",
                                                                       "--max-parallel-tool-calls", "3"),
                          env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def call_bias(tool_model) -> dict[str, int]:
    return {str(tool_model[1]): 100}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_a_tool_when_the_model_starts_one(client, call_bias, stream):
    kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, temperature=1.0, seed=5, max_tokens=100, n=2,
              logit_bias=call_bias)
    if not stream:
        resp = client.chat.completions.create(**kw)
        assert len(resp.choices) == 2
        for c in resp.choices:
            assert c.finish_reason == "tool_calls" and not c.message.content, c
            [call] = c.message.tool_calls
            assert call.function.name == "get_weather" and call.id
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        return
    calls: dict[int, dict] = {}
    finish = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            assert not ch.delta.content
            for d in ch.delta.tool_calls or []:
                assert d.index == 0
                entry = calls.setdefault(ch.index, {"name": None, "args": ""})
                if d.id:
                    entry["name"] = d.function.name
                    assert d.function.arguments == ""
                else:
                    entry["args"] += d.function.arguments
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for entry in calls.values():
        assert entry["name"] == "get_weather"
        jsonschema.validate(json.loads(entry["args"]), WEATHER)


def test_auto_plain_text_stays_content(client):
    """Unsteered, the random model writes text, and the grammar lets it (explicit "auto" too)."""
    resp = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="auto",
                                          temperature=0, max_tokens=12)
    c = resp.choices[0]
    assert c.message.content and not c.message.tool_calls and c.finish_reason in ("stop", "length")


def test_bad_tool_schema_is_400(client):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(ab"}}}}}]
    with pytest.raises(openai.BadRequestError, match="parenthesis is not closed") as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, tools=bad, max_tokens=4)
    assert e.value.body["type"] == "invalid_request_error"


def test_required_is_bounded_by_the_flag(client):
    resp = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
                                          temperature=1.0, seed=2, max_tokens=200, n=3)
    for c in resp.choices:
        if c.finish_reason == "tool_calls":
            assert 1 <= len(c.message.tool_calls) <= 3
        for call in c.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_langchain_bind_tools(server, call_bias):
    from langchain_openai import ChatOpenAI

    def get_weather(city: Literal["Paris", "Tokyo", "Lima"], days: int) -> str:
        """Weather for a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key=API_KEY, temperature=1.0, seed=5, max_tokens=100,
                     logit_bias={int(k): v for k, v in call_bias.items()}, max_retries=0)
    msg = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    assert len(msg.tool_calls) == 1, msg
    [call] = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Tokyo", "Lima")
    assert isinstance(call["args"]["days"], int)


def test_openai_agents_chat_completions_model(server, call_bias):
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Tokyo", "Lima"]) -> str:
        """Weather for a city."""
        return f"sunny in {city}"

    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(
        base_url=f"{server}/v1", api_key=API_KEY, max_retries=0))
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather tool.", model=model, tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(temperature=1.0, max_tokens=100,
                                            extra_body={"logit_bias": call_bias, "seed": 5}),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert result.final_output in ("sunny in Paris", "sunny in Tokyo", "sunny in Lima")
