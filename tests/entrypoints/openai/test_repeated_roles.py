"""Repeated roles through every route that renders a conversation (issue 44, item 1), on a template
that demands strict alternation as Gemma's does: parallel tool results (chat `tool` messages,
Responses `function_call_output` items), two user messages in a row, and a Conversation ending in a
user message followed by `responses.create(conversation=...)` all render (chat_turns.py), where
they used to be a 400 "Conversation roles must alternate"."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig

# Gemma's rules, in short: one system message, first; then user (or tool) and assistant turns alternate.
STRICT = (
    "{% set first = messages[0]['role'] == 'system' %}{% if first %}s:{{ messages[0]['content'] }}\n{% endif %}"
    "{% set rest = messages[1:] if first else messages %}{% for m in rest %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('a system message only comes first') }}{% endif %}"
    "{% if (m['role'] == 'assistant') != (loop.index0 % 2 == 1) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]
PARALLEL = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": CALLS},
            {"role": "tool", "tool_call_id": "call_1", "content": "21"},
            {"role": "tool", "tool_call_id": "call_2", "content": "10:00"}]
TWO_USERS = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Weather?"}]


@pytest.fixture
def client(fake_engine):
    fake_engine.model_config.max_model_len = 1024
    with TestClient(build_app(fake_engine, ServerConfig(served_model_names=("fake-model",),
                                                        chat_template=STRICT))) as c:
        yield c


def _prompt(engine) -> str:
    return engine.calls[-1][0]["prompt"]


@pytest.mark.parametrize("messages, prompt", [
    (PARALLEL, "u:Weather?\na:\nu:21\n\n10:00\na:"),
    (TWO_USERS, "u:Hi\n\nWeather?\na:"),
])
def test_chat_and_tokenize(client, fake_engine, messages, prompt):
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert _prompt(fake_engine) == prompt
    r = client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    assert client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"] == prompt


def test_responses_parallel_function_call_outputs(client, fake_engine):
    items = [{"role": "user", "content": "Weather?"}]
    items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
               "arguments": c["function"]["arguments"]} for c in CALLS]
    items += [{"type": "function_call_output", "call_id": "call_1", "output": "21"},
              {"type": "function_call_output", "call_id": "call_2", "output": "10:00"}]
    r = client.post("/v1/responses", json={"input": items, "max_output_tokens": 1})
    assert r.status_code == 200 and r.json()["status"] == "incomplete", r.text
    assert _prompt(fake_engine) == "u:Weather?\na:\nu:21\n\n10:00\na:"


def test_responses_instructions_developer_and_two_users(client, fake_engine):
    r = client.post("/v1/responses", json={"input": [{"role": "developer", "content": "Short"}, *TWO_USERS],
                                           "instructions": "Be brief", "max_output_tokens": 1})
    assert r.status_code == 200, r.text
    assert _prompt(fake_engine) == "s:Be brief\n\nShort\nu:Hi\n\nWeather?\na:"


def test_conversation_ending_in_a_user_message(client, fake_engine):
    conv = client.post("/v1/conversations", json={"items": [{"role": "user", "content": "Hi"}]}).json()
    r = client.post("/v1/responses", json={"conversation": conv["id"], "input": "Weather?", "max_output_tokens": 1})
    assert r.status_code == 200, r.text
    assert _prompt(fake_engine) == "u:Hi\n\nWeather?\na:"
    # and the next turn, after the model's answer, renders too
    r = client.post("/v1/responses", json={"conversation": conv["id"], "input": "More?", "max_output_tokens": 1})
    assert r.status_code == 200, r.text
    assert _prompt(fake_engine) == "u:Hi\n\nWeather?\na: w0\nu:More?\na:"


def test_what_cannot_be_fitted_is_still_a_400(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "Hello"}],
                                                  "max_tokens": 1})
    assert r.status_code == 400 and "alternate" in r.json()["error"]["message"]
