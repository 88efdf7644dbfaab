"""The Responses and Conversations APIs through a real `pagedllm serve` on a tiny random-weight
Qwen3, driven by the openai SDK and the openai-agents package. A random model never learned
tools or JSON: calls and JSON come from the structured-output grammars of `tool_choice` and
`text.format`, which is what these tests rely on."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.openai.conftest import CHAT_TEMPLATE
from tests.entrypoints.openai.serve_utils import API_KEY, AUTH, MODEL, metrics_once_idle, serve_tiny

THINK_OFF_TEMPLATE = CHAT_TEMPLATE.replace("assistant:", "assistant:<think>\n\n</think>\n\n")
THINK_ON_TEMPLATE = CHAT_TEMPLATE.replace("assistant:", "assistant:<think>\n")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
GREEDY = dict(temperature=0, max_output_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_qwen3_think, tmp_path_factory):
    """One grammar compiler process, not the default two (each imports xgrammar, seconds of CPU):
    these tests' grammars are small (test_grammar_compile_jam.py tests the default two)."""
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
             "--trust-request-chat-template", "--chat-template", THINK_OFF_TEMPLATE)
    yield from serve_tiny(tiny_qwen3_think, tmp_path_factory, extra_args=flags,
                          env={"PAGEDLLM_GRAMMAR_COMPILE_WORKERS": "1"})


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def _poll(client, response_id: str, until: tuple[str, ...], timeout: float = 60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = client.responses.retrieve(response_id)
        if r.status in until:
            return r
        time.sleep(0.05)
    raise AssertionError(f"response {response_id} stayed {r.status}")


def test_create_equals_stream_and_chat(client):
    kwargs = dict(model=MODEL, input="Hello, my name is", instructions="Be brief.", **GREEDY)
    resp = client.responses.create(**kwargs)
    assert resp.object == "response" and resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    [msg] = resp.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert resp.output_text == msg.content[0].text and resp.output_text
    assert resp.usage.output_tokens == 12 and resp.usage.total_tokens == resp.usage.input_tokens + 12
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert kind in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == resp.output_text == events[-1].response.output_text
    # The same conversation through chat completions gives the same text.
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hello, my name is"}],
        temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == resp.output_text


def test_stream_helper_assembles_the_non_streaming_response(client):
    """The SDK's helper needs response.completed: a grammar makes the random model finish."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}},
              "required": ["answer"], "additionalProperties": False}
    kwargs = dict(model=MODEL, input="Yes or no?", temperature=0, max_output_tokens=40,
                  text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    resp = client.responses.create(**kwargs)
    assert resp.status == "completed" and json.loads(resp.output_text)["answer"] in ("yes", "no", "maybe")
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == resp.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (resp.usage.input_tokens, resp.usage.output_tokens)
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again
    assert [(i.type, i.status) for i in final.output] == [(i.type, i.status) for i in resp.output]


def test_output_text_logprobs(client):
    kwargs = dict(model=MODEL, input="Hello", include=["message.output_text.logprobs"], top_logprobs=2, **GREEDY)
    resp = client.responses.create(**kwargs)
    lps = resp.output[0].content[0].logprobs
    assert len(lps) == 12 and "".join(lp.token for lp in lps) == resp.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, round(lp.logprob, 4)) for lp in streamed] == [(lp.token, round(lp.logprob, 4)) for lp in lps]
    plain = client.responses.create(model=MODEL, input="Hello", **GREEDY)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == resp.output_text


def test_store_retrieve_input_items_delete(client):
    resp = client.responses.create(model=MODEL, input=[{"role": "developer", "content": "Be brief."},
                                                       {"role": "user", "content": [{"type": "input_text",
                                                                                     "text": "Hi"}]}],
                                   metadata={"k": "v"}, **GREEDY)
    got = client.responses.retrieve(resp.id)
    assert got.output_text == resp.output_text and got.metadata == {"k": "v"} and got.status == resp.status
    items = client.responses.input_items.list(resp.id, order="asc")
    assert [i.role for i in items.data] == ["developer", "user"]
    page = client.responses.input_items.list(resp.id, limit=1)  # newest first, as OpenAI lists
    assert [i.role for i in page.data] == ["user"] and page.has_more
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_previous_response_id_continues_from_the_prefix_cache(client):
    first = client.responses.create(model=MODEL, input="The quick brown fox jumps over the lazy dog. " * 3,
                                    **GREEDY)
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id, **GREEDY)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16  # the first turn's blocks
    # The same history sent in full gives the same answer.
    again = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 3},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}], **GREEDY)
    assert again.output_text == second.output_text


def test_prompt_cache_key_salts_the_cache(client):
    text = "Paged attention stores keys and values in fixed-size blocks. " * 2
    client.responses.create(model=MODEL, input=text, prompt_cache_key="tenant-a", store=False, **GREEDY)
    same = client.responses.create(model=MODEL, input=text, prompt_cache_key="tenant-a", store=False, **GREEDY)
    other = client.responses.create(model=MODEL, input=text, prompt_cache_key="tenant-b", store=False, **GREEDY)
    assert same.usage.input_tokens_details.cached_tokens > 0
    assert other.usage.input_tokens_details.cached_tokens == 0
    with pytest.raises(openai.NotFoundError):  # store=false keeps nothing
        client.responses.retrieve(same.id)


def test_background_poll_cancel_and_replay(client, server):
    slow = client.responses.create(model=MODEL, input="Count", background=True, temperature=0,
                                   max_output_tokens=200, extra_body={"ignore_eos": True})
    assert slow.status == "queued" and slow.background
    _poll(client, slow.id, ("in_progress",))
    cancelled = client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(slow.id).status == "cancelled"
    metrics_once_idle(server, wait_s=10.0)

    done = client.responses.create(model=MODEL, input="Hello", background=True, **GREEDY)
    final = _poll(client, done.id, ("completed", "incomplete"))
    assert final.output_text and final.usage.output_tokens == 12
    events = list(client.responses.retrieve(done.id, stream=True, starting_after=3))
    assert events[0].sequence_number == 4 and events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(4, 4 + len(events)))
    assert events[-1].response.output_text == final.output_text
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        client.responses.cancel(client.responses.create(model=MODEL, input="Hi", **GREEDY).id)


def test_background_stream_can_be_resumed(client):
    with client.responses.create(model=MODEL, input="Hello", background=True, stream=True, **GREEDY) as stream:
        events = iter(stream)
        first = [next(events) for _ in range(3)]
    rid = first[0].response.id
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=first[-1].sequence_number))
    seqs = [e.sequence_number for e in first + rest]
    assert seqs == list(range(len(seqs))) and rest[-1].type == "response.incomplete"


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    resp = client.responses.create(model=MODEL, input="A person as JSON", max_output_tokens=60, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    jsonschema.validate(json.loads(resp.output_text), schema)
    obj = client.responses.create(model=MODEL, input="JSON", max_output_tokens=60, temperature=0,
                                  text={"format": {"type": "json_object"}})
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


def test_function_call_round_trip(client):
    resp = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                   tool_choice="required", parallel_tool_calls=False, temperature=0,
                                   max_output_tokens=60)
    [call] = [i for i in resp.output if i.type == "function_call"]
    assert call.name == "get_weather" and resp.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = client.responses.create(model=MODEL, previous_response_id=resp.id, tools=TOOLS, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "22 C and sunny"}], **GREEDY)
    assert answer.output[0].type == "message" and answer.output_text
    # Streamed, a call arrives as function_call_arguments deltas and the SDK assembles the same item.
    named = {"type": "function", "name": "get_weather"}
    with client.responses.stream(model=MODEL, input="Weather?", tools=TOOLS, tool_choice=named, temperature=0,
                                 max_output_tokens=60) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_response()
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= kinds
    [call] = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_tool_outputs_resume_the_same_response(client, server):
    resp = client.responses.create(model=MODEL, input="Weather in Lima?", tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, temperature=0, max_output_tokens=60)
    [call] = [i for i in resp.output if i.type == "function_call"]
    seen = len(list(client.responses.retrieve(resp.id, stream=True)))
    r = httpx.post(f"{server}/v1/responses/{resp.id}/tool_outputs", headers=AUTH,
                   json={"tool_call_id": call.call_id, "output": [{"type": "output_text", "text": "Sunny"}]})
    assert r.status_code == 200 and r.json()["status"] == "in_progress", r.text
    # The model's next turn joins the same response; the stream continues after what was seen.
    rest = list(client.responses.retrieve(resp.id, stream=True, starting_after=seen - 1))
    assert rest[0].sequence_number == seen and rest[0].type == "response.in_progress"
    final = client.responses.retrieve(resp.id)
    assert final.status in ("completed", "incomplete")
    assert [i.type for i in final.output][0] == "function_call" and final.output[-1].type == "message"
    assert final.usage.input_tokens > resp.usage.input_tokens
    items = client.responses.input_items.list(resp.id, order="asc").data
    assert items[-1].type == "function_call_output" and items[-1].call_id == call.call_id
    again = httpx.post(f"{server}/v1/responses/{resp.id}/tool_outputs", headers=AUTH,
                       json={"tool_call_id": call.call_id, "output": "x"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "tool_call_id"


def test_reasoning_items(client, server):
    """The random model is pushed (logit_bias) to open a think block it never closes: all reasoning."""
    tok = httpx.post(f"{server}/tokenize", headers=AUTH, json={"prompt": "<think>", "add_special_tokens": False})
    [think] = tok.json()["tokens"]
    kwargs = dict(model=MODEL, input="Think first", reasoning={"effort": "low"}, temperature=0,
                  max_output_tokens=8, extra_body={"ignore_eos": True, "chat_template": CHAT_TEMPLATE,
                                                   "logit_bias": {str(think): 100}})
    resp = client.responses.create(**kwargs)
    [reasoning] = resp.output
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == "<think>" * 7 and resp.output_text == ""
    assert resp.usage.output_tokens_details.reasoning_tokens == 7 and resp.usage.output_tokens == 8
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == deltas and events[-1].response.output[0].content[0].text == deltas


def test_conversations(client):
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
                                       metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    resp = client.responses.create(model=MODEL, input="What is my name?", conversation=conv.id, **GREEDY)
    assert resp.conversation.id == conv.id
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "message"]
    assert [i.role for i in items] == ["user", "user", "assistant"]
    assert items[2].content[0].text == resp.output_text
    added = client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user",
                                                                "content": "Thanks"}])
    assert client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).content[0].text == "Thanks"
    client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert len(client.conversations.items.list(conv.id).data) == 3
    assert client.conversations.update(conv.id, metadata={"topic": "x"}).metadata == {"topic": "x"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "x"}
    client.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", conversation=conv.id)


def test_errors(client, server):
    for call in (lambda: client.responses.retrieve("resp_missing"), lambda: client.responses.cancel("resp_missing"),
                 lambda: client.responses.delete("resp_missing"),
                 lambda: client.responses.input_items.list("resp_missing"),
                 lambda: client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == 404 and e.value.body["type"]
    for body, param in (({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
                        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
                         "input[0].content"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
                         "input"),  # a text-only model
                        ({"input": "x", "background": True, "store": False}, "background"),
                        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
                        ({"input": "x", "include": ["everything"]}, "include")):
        r = httpx.post(f"{server}/v1/responses", headers=AUTH, json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    resp = client.responses.create(model=MODEL, input="x", tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, temperature=0, max_output_tokens=60)
    call_id = resp.output[0].call_id
    big = httpx.post(f"{server}/v1/responses/{resp.id}/tool_outputs", headers=AUTH,
                     json={"tool_call_id": call_id, "output": "x" * (1024 * 1024 + 1)})
    assert big.status_code == 400 and "--max-tool-output-bytes" in big.json()["error"]["message"]
    assert httpx.get(f"{server}/health").status_code == 200


def test_openai_agents_run_calls_the_tool(server):
    """The Agents SDK's default model is the Responses one. The tiny model never learned tools or
    JSON, so grammars decide: the first turn runs under tool_choice="required" (a call); the SDK then
    resets the choice to auto, and the agent's output_type (a JSON schema in text.format) makes the
    model's answer one that ends the run."""
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: str = Field(max_length=12)

    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    agents.set_tracing_disabled(True)

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
        agent = agents.Agent(name="weather", instructions="Use tools.", tools=[get_weather], model=model,
                             output_type=Forecast,
                             model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                                 max_tokens=60, temperature=0))
        return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    assert calls in (["Paris"], ["Lima"])
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, Forecast)


def test_sqlite_store_survives_a_restart(tiny_llama, tmp_path_factory, tmp_path):
    """--responses-store sqlite:///...: a stored response, its stream and a conversation outlive the server."""
    flags = ("--responses-store", f"sqlite:///{tmp_path}/responses.db")
    first = serve_tiny(tiny_llama, tmp_path_factory, extra_args=flags)
    client = openai.OpenAI(base_url=f"{next(first)}/v1", api_key=API_KEY, max_retries=0)
    resp = client.responses.create(model=MODEL, input="Hello", **GREEDY)
    conv = client.conversations.create(items=[{"role": "user", "content": "Remember me"}])
    first.close()  # the server process stops

    second = serve_tiny(tiny_llama, tmp_path_factory, extra_args=flags)
    client = openai.OpenAI(base_url=f"{next(second)}/v1", api_key=API_KEY, max_retries=0)
    try:
        got = client.responses.retrieve(resp.id)
        assert got.output_text == resp.output_text and got.usage.output_tokens == 12
        events = list(client.responses.retrieve(resp.id, stream=True))
        assert events[-1].type == "response.incomplete" and events[-1].response.output_text == resp.output_text
        follow = client.responses.create(model=MODEL, input="More", previous_response_id=resp.id, **GREEDY)
        assert follow.usage.input_tokens > resp.usage.input_tokens + 12
        assert client.conversations.items.list(conv.id).data[0].content[0].text == "Remember me"
    finally:
        second.close()
