"""A two-call tool round trip through the openai SDK against a real `pagedllm serve`, with the
default model's family template (issue 44, items 1 and 2): a tiny Gemma 3 whose vocabulary holds
Gemma's turn markers and which has no chat template, served without --chat-template, so pagedllm's
gemma.jinja is its own template and tool requests render with tool_gemma3.jinja (the families with
tool templates: tests/entrypoints/test_tool_templates.py). A random model never learned tools:
`required` makes the calls (a grammar), then the results of the parallel calls go back as one
`tool` message (chat) or `function_call_output` item (Responses) each, and must reach the prompt."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.entrypoints.openai.serve_utils import AUTH, MODEL, serve_tiny
from tests.utils import make_tiny_model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
USER = {"role": "user", "content": "Weather and time in Paris?"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("gemma3_vocab")), "gemma3",
                            added_tokens=("<start_of_turn>", "<end_of_turn>"), max_position_embeddings=4096)
    logs: list = []
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-model-len", "2048")
    gen = serve_tiny(model, tmp_path_factory, extra_args=flags, logs=logs, chat_template=None)
    url = next(gen)
    yield url, logs[0]
    gen.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="test-key", max_retries=0)


def _rendered(url: str, messages: list[dict]) -> tuple[str, int]:
    r = httpx.post(f"{url}/tokenize", headers=AUTH, json={"model": MODEL, "messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    d = httpx.post(f"{url}/detokenize", headers=AUTH, json={"model": MODEL, "tokens": r.json()["tokens"]})
    return d.json()["prompt"], r.json()["count"]


def test_chat_round_trip_with_parallel_results(client, server):
    url, log = server
    first = client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=5, n=6, max_tokens=300)
    parallel = [c for c in first.choices if c.finish_reason == "tool_calls" and len(c.message.tool_calls) >= 2]
    assert parallel, "some choice should call tools in parallel"
    choice = parallel[0]
    calls = choice.message.tool_calls
    results = [{"role": "tool", "tool_call_id": c.id, "content": f"result {i}: 21 degrees"}
               for i, c in enumerate(calls)]
    history = [USER, choice.message.model_dump(exclude_none=True), *results]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt, count = _rendered(url, history)
    assert second.usage.prompt_tokens == count
    for tool in TOOLS:
        assert tool["function"]["name"] in prompt and tool["function"]["description"] in prompt
    for call in calls:
        assert f'{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}' in prompt
    assert all(f"<tool_response>\n{r['content']}\n</tool_response>" in prompt for r in results)
    assert prompt.endswith("</tool_response><end_of_turn>\n<start_of_turn>model\n")
    text = open(log).read()  # the switch to the tool template is logged once
    assert text.count("requests with tools render with pagedllm's gemma3 tool template") == 1


def test_responses_round_trip_with_parallel_outputs(client):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    first = client.responses.create(model=MODEL, input=USER["content"], tools=tools, tool_choice="required",
                                    temperature=1.0, max_output_tokens=200, extra_body={"seed": 5, "n": 1})
    calls = [i for i in first.output if i.type == "function_call"]
    assert calls and first.status == "completed"
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": f"result {i}"}
               for i, c in enumerate(calls)]
    answer = client.responses.create(model=MODEL, previous_response_id=first.id, input=outputs, tools=tools,
                                     temperature=0, max_output_tokens=8)
    assert answer.status in ("completed", "incomplete") and answer.output
    # a history the client keeps itself: two calls, then their two outputs
    items = [{"role": "user", "content": USER["content"]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"zone": "CET"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "21 degrees"},
             {"type": "function_call_output", "call_id": "c2", "output": "10:42"}]
    answer = client.responses.create(model=MODEL, input=items, tools=tools, temperature=0, max_output_tokens=8)
    assert answer.status in ("completed", "incomplete") and answer.output


def test_tool_arguments_json_reach_the_prompt_as_sent(server):
    url, _ = server
    call = {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    prompt, _ = _rendered(url, [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "call_a", "content": "10:42"}])
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>' in prompt
    assert json.dumps(WEATHER) in prompt  # the tools' schemas, as JSON
