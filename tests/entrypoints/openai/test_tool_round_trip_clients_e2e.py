"""A two-call tool round trip through openai-agents (its chat-completions model) and LangChain's
`ChatOpenAI.bind_tools` against a real `pagedllm serve` with the default model's family template
(issue 44, item 2): the tiny Gemma-vocabulary model of test_tool_round_trip_e2e.py, served without
--chat-template, so tool requests render with tool_gemma3.jinja. A random model never learned
tools, so `tool_choice="required"` makes the calls (a grammar, which also makes the arguments
valid for the tools' schemas); how many calls a turn makes is up to the sampler, so each test
tries a few seeds until one turn calls two tools (both tools, for the agent). The client then runs
the tools, sends both results back as `tool` messages and gets a final answer; the results must
reach the prompt of that answer (/tokenize of the very body the client sent agrees with the
answer's prompt_tokens and shows each result as a <tool_response>)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import httpx
import openai
import pytest

from tests.entrypoints.openai.serve_utils import API_KEY, AUTH, MODEL, serve_tiny
from tests.entrypoints.openai.test_tool_round_trip_e2e import TOOLS, USER
from tests.utils import make_tiny_model

SEEDS = range(12)  # a required turn calls one or two tools (--max-parallel-tool-calls 2), at random
NAMES = {t["function"]["name"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Any:
    model = make_tiny_model(str(tmp_path_factory.mktemp("gemma3_vocab")), "gemma3",
                            added_tokens=("<start_of_turn>", "<end_of_turn>"), max_position_embeddings=4096)
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-model-len", "2048",
             "--max-parallel-tool-calls", "2")
    yield from serve_tiny(model, tmp_path_factory, extra_args=flags, chat_template=None)


def _chat_bodies(sent: list[dict], request: httpx.Request) -> None:
    if request.url.path.endswith("/chat/completions"):
        sent.append(json.loads(request.content))


def _assert_results_in_prompt(url: str, body: dict, results: dict[str, str], prompt_tokens: int) -> None:
    """The body the client sent for the answer holds one `tool` message per call id, with that call's
    result, and the server rendered them: /tokenize of that body gives the answer's prompt_tokens
    and its text holds each result as a <tool_response> after the calls."""
    tool_msgs = {m["tool_call_id"]: m["content"] for m in body["messages"] if m["role"] == "tool"}
    assert tool_msgs == results
    [asked] = [m for m in body["messages"] if m["role"] == "assistant"]
    assert {c["id"] for c in asked["tool_calls"]} == set(results)
    r = httpx.post(f"{url}/tokenize", headers=AUTH,
                   json={"model": MODEL, "messages": body["messages"], "tools": body["tools"]})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == prompt_tokens
    d = httpx.post(f"{url}/detokenize", headers=AUTH, json={"model": MODEL, "tokens": r.json()["tokens"]})
    prompt = d.json()["prompt"]
    for call in asked["tool_calls"]:
        assert f'{{"name": "{call["function"]["name"]}", "arguments": ' in prompt
    for result in results.values():
        assert f"<tool_response>\n{result}\n</tool_response>" in prompt
    assert prompt.endswith("</tool_response><end_of_turn>\n<start_of_turn>model\n")


def test_openai_agents_chat_completions_round_trip(server):
    """The runner calls both tools of the first (required) turn, sends their outputs back (the SDK
    resets tool_choice to auto after a call) and the run ends with the model's text."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    ran: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:
        """Weather in a city."""
        ran.append(("get_weather", out := f"21 degrees in {city} ({len(ran)})"))
        return out

    @agents.function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """Time in a zone."""
        ran.append(("get_time", out := f"10:42 {zone} ({len(ran)})"))
        return out

    async def run(seed: int, sent: list[dict]) -> Any:
        async def hook(request: httpx.Request) -> None:
            _chat_bodies(sent, request)

        async with httpx.AsyncClient(event_hooks={"request": [hook]}, timeout=120) as http:
            client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, http_client=http)
            agent = agents.Agent(
                name="assistant", instructions="Use the tools.", tools=[get_weather, get_time],
                model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                model_settings=agents.ModelSettings(tool_choice="required", temperature=1.0, max_tokens=200,
                                                    extra_body={"seed": seed}))
            return await agents.Runner.run(agent, USER["content"], max_turns=3)

    for seed in SEEDS:
        ran.clear()
        sent: list[dict] = []
        result = asyncio.run(run(seed, sent))
        if {name for name, _ in ran} == NAMES:
            break
    else:
        pytest.fail(f"no seed in {SEEDS} made the first turn call both tools")

    assert len(result.raw_responses) == len(sent) == 2  # the calls, then the answer
    assert sent[0]["tool_choice"] == "required" and "tool_choice" not in sent[1]  # reset: auto
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item"] * 2 + ["tool_call_output_item"] * 2 + ["message_output_item"], kinds
    assert [item.raw_item.name for item in result.new_items[:2]] == [name for name, _ in ran]
    outputs = {item.raw_item["call_id"]: item.output for item in result.new_items[2:4]}
    assert sorted(outputs.values()) == sorted(out for _, out in ran)
    assert isinstance(result.final_output, str)
    _assert_results_in_prompt(server, sent[1], outputs, result.raw_responses[1].usage.input_tokens)


def test_langchain_bind_tools_round_trip(server):
    """One AIMessage with two tool_calls, ToolMessages back, a final AIMessage."""
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    def run_tool(name: str, args: dict[str, Any], i: int) -> str:  # any JSON arguments do
        return f"{name} result {i}: {json.dumps(args, sort_keys=True)}"

    sent: list[dict] = []
    http = httpx.Client(event_hooks={"request": [lambda request: _chat_bodies(sent, request)]}, timeout=120)

    def llm(seed: int, max_tokens: int) -> ChatOpenAI:
        return ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key=API_KEY, temperature=1.0, seed=seed,
                          max_tokens=max_tokens, max_retries=0, http_client=http, use_responses_api=False)

    question = HumanMessage(USER["content"])
    with http:
        for seed in SEEDS:
            asked = llm(seed, 200).bind_tools(TOOLS, tool_choice="required").invoke([question])
            if asked.response_metadata["finish_reason"] == "tool_calls" and len(asked.tool_calls) == 2:
                break
        else:
            pytest.fail(f"no seed in {SEEDS} made a complete turn with two tool calls")
        assert isinstance(asked, AIMessage) and not asked.invalid_tool_calls
        assert {c["name"] for c in asked.tool_calls} <= NAMES and len({c["id"] for c in asked.tool_calls}) == 2
        results = [ToolMessage(run_tool(c["name"], c["args"], i), tool_call_id=c["id"])
                   for i, c in enumerate(asked.tool_calls)]
        answer = llm(0, 8).bind_tools(TOOLS).invoke([question, asked, *results])
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    assert sent[-1]["messages"][-len(results):] == [
        {"role": "tool", "tool_call_id": r.tool_call_id, "content": r.content} for r in results]
    _assert_results_in_prompt(server, sent[-1], {r.tool_call_id: r.content for r in results},
                              answer.usage_metadata["input_tokens"])
