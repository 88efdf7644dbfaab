"""The Responses and Conversations routes over the scripted engine (each request emits " w0 w1 ..."
one word per step and stops at max_output_tokens): the store settings, background lifetimes, the
tool-output resume, pagination and the 400s / 404s, without a model."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE
from tests.entrypoints.openai.fake_engine import FakeEngine

TOOLS = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}


def _client(engine: FakeEngine, **config) -> TestClient:
    return TestClient(build_app(engine, ServerConfig(chat_template=CHAT_TEMPLATE, **config)))


def _error(r, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and (param is None or error["param"] == param), error
    return error


def _wait(c: TestClient, rid: str, statuses: tuple[str, ...]) -> dict:
    for _ in range(400):
        body = c.get(f"/v1/responses/{rid}").json()
        if body.get("status") in statuses:
            return body
        time.sleep(0.01)
    raise AssertionError(body)


def test_response_body_and_prompt(fake_engine):
    with _client(fake_engine) as c:
        r = c.post("/v1/responses", json={"input": [{"role": "developer", "content": "Be brief"},
                                                   {"role": "user", "content": "Hi"}],
                                          "max_output_tokens": 3, "top_k": 5, "seed": 7, "user": "u1"})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "incomplete" and body["output_text"] == " w0 w1 w2"
        assert body["usage"]["output_tokens"] == 3 and body["user"] == "u1"
        prompt, params, *_ = fake_engine.calls[-1]
        assert prompt["prompt"] == "system: Be brief\nuser: Hi\nassistant:"
        assert (params.top_k, params.seed, params.max_tokens) == (5, 7, 3)


def test_store_disabled(fake_engine):
    with _client(fake_engine, disable_responses_store=True) as c:
        ok = c.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1})
        assert ok.status_code == 200 and ok.json()["store"] is False  # store left out: not stored, no error
        _error(c.post("/v1/responses", json={"input": "Hi", "store": True}), 400, "store")
        _error(c.post("/v1/responses", json={"input": "Hi", "background": True}), 400, "background")
        _error(c.get(f"/v1/responses/{ok.json()['id']}"), 404)
        _error(c.post("/v1/conversations", json={}), 400)


def test_background_cancel_aborts_the_engine_request(fake_tokenizer, fake_model_dir):
    engine = FakeEngine(fake_tokenizer, fake_model_dir, step_delay=0.02)
    with _client(engine) as c:
        r = c.post("/v1/responses", json={"input": "Hi", "background": True, "max_output_tokens": 40})
        assert r.json()["status"] == "queued"
        rid = r.json()["id"]
        _wait(c, rid, ("in_progress",))
        assert c.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
        assert engine.aborted and not engine.live
        assert c.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
        assert c.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"  # again: no change


def test_expired_background_response_is_cancelled(fake_tokenizer, fake_model_dir):
    engine = FakeEngine(fake_tokenizer, fake_model_dir, step_delay=0.05)
    with _client(engine, responses_store_ttl=0.3) as c:
        rid = c.post("/v1/responses", json={"input": "Hi", "background": True, "max_output_tokens": 40}).json()["id"]
        time.sleep(0.5)
        _error(c.get(f"/v1/responses/{rid}"), 404)
        for _ in range(100):
            if not engine.live:
                break
            time.sleep(0.01)
        assert engine.aborted and not engine.live


def test_stream_disconnect_cancels_a_foreground_response(fake_tokenizer, fake_model_dir):
    engine = FakeEngine(fake_tokenizer, fake_model_dir, step_delay=0.02)
    with _client(engine) as c:
        with c.stream("POST", "/v1/responses", json={"input": "Hi", "stream": True, "max_output_tokens": 40}) as r:
            next(r.iter_lines())
        for _ in range(100):
            if not engine.live:
                break
            time.sleep(0.01)
        assert engine.aborted and not engine.live


def test_tool_outputs_resume_and_conversation(fake_engine):
    with _client(fake_engine, max_tool_output_bytes=64) as c:
        conv = c.post("/v1/conversations", json={"metadata": {"a": "b"}}).json()
        body = {"input": "Go", "tools": TOOLS, "tool_choice": {"type": "function", "name": "lookup"},
                "max_output_tokens": 2, "conversation": conv["id"]}
        first = c.post("/v1/responses", json=body).json()
        [call] = first["output"]
        assert call["type"] == "function_call" and call["name"] == "lookup" and call["arguments"] == " w0 w1"
        _error(c.post(f"/v1/responses/{first['id']}/tool_outputs", json={"tool_call_id": "nope", "output": "x"}),
               400, "tool_call_id")
        _error(c.post(f"/v1/responses/{first['id']}/tool_outputs",
                      json={"tool_call_id": call["call_id"], "output": "x" * 65}), 400, "output")
        _error(c.post(f"/v1/responses/{first['id']}/tool_outputs", json={}), 400, "tool_outputs")
        r = c.post(f"/v1/responses/{first['id']}/tool_outputs",
                   json={"tool_outputs": [{"call_id": call["call_id"], "output": "42"}]})
        assert r.json() == {"id": first["id"], "status": "in_progress", "pending_tool_calls": []}
        final = _wait(c, first["id"], ("completed", "incomplete"))
        assert [i["type"] for i in final["output"]] == ["function_call", "message"]
        assert final["usage"]["output_tokens"] == 4
        prompt = fake_engine.calls[-1][0]["prompt"]
        assert prompt.endswith("user: Go\nassistant: \ntool: 42\nassistant:")
        assert fake_engine.calls[-1][1].structured_outputs is None  # the named choice does not force again
        items = c.get(f"/v1/conversations/{conv['id']}/items", params={"order": "asc"}).json()["data"]
        assert [i["type"] for i in items] == ["message", "function_call", "function_call_output", "message"]
        inputs = c.get(f"/v1/responses/{first['id']}/input_items", params={"order": "asc"}).json()["data"]
        assert [i["type"] for i in inputs] == ["message", "function_call_output"]


def test_pagination(fake_engine):
    with _client(fake_engine) as c:
        words = [{"role": "user", "content": f"m{i}"} for i in range(5)]
        conv = c.post("/v1/conversations", json={"items": words}).json()
        url = f"/v1/conversations/{conv['id']}/items"
        page = c.get(url, params={"limit": 2, "order": "asc"}).json()
        assert [i["content"][0]["text"] for i in page["data"]] == ["m0", "m1"] and page["has_more"]
        rest = c.get(url, params={"limit": 10, "order": "asc", "after": page["last_id"]}).json()
        assert [i["content"][0]["text"] for i in rest["data"]] == ["m2", "m3", "m4"] and not rest["has_more"]
        assert c.get(url).json()["data"][0]["content"][0]["text"] == "m4"  # desc by default
        _error(c.get(url, params={"limit": 0}), 400)
        _error(c.get(url, params={"order": "up"}), 400, "order")
        _error(c.get(url, params={"after": "msg_x"}), 400, "after")


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0]"),
    ({"input": ""}, "input"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "x", "previous_response_id": "resp_1", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": TOOLS}, "tool_choice"),  # auto needs --enable-auto-tool-choice, as in chat
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": 3}}}, "text.format.schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "prompt_cache_key": ""}, "prompt_cache_key"),
    ({"input": "x" * 500}, "input"),  # longer than the model's context
    # Schemas the grammar compiler refuses: 400 now, as in chat, not a response that fails later.
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": BAD_SCHEMA}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": BAD_SCHEMA}}, "stream": True},
     "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": BAD_SCHEMA}}, "store": True,
      "background": True}, "text.format"),
    ({"input": "x", "structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs"),
    ({"input": "x", "tools": [{**TOOLS[0], "parameters": BAD_SCHEMA}], "tool_choice": {"type": "function",
                                                                                        "name": "lookup"}}, "tools"),
])
def test_bad_requests_are_400(fake_engine, body, param):
    with _client(fake_engine) as c:
        _error(c.post("/v1/responses", json=body), 400, param)
        assert not fake_engine.calls


def test_truncation_auto_drops_the_oldest_turns(fake_engine):
    with _client(fake_engine) as c:
        long = [{"role": "user", "content": "y" * 20}, {"role": "assistant", "content": "z" * 20}]
        body = {"input": long + [{"role": "user", "content": "Hi"}], "max_output_tokens": 4}
        _error(c.post("/v1/responses", json=body), 400, "input")
        ok = c.post("/v1/responses", json={**body, "truncation": "auto"})
        assert ok.status_code == 200, ok.text
        prompt = fake_engine.calls[-1][0]["prompt"]
        assert "y" * 20 not in prompt and prompt.endswith("user: Hi\nassistant:")


def test_unknown_ids_are_404(fake_engine):
    with _client(fake_engine) as c:
        for method, path in (("GET", "/v1/responses/x"), ("POST", "/v1/responses/x/cancel"),
                             ("DELETE", "/v1/responses/x"), ("GET", "/v1/responses/x/input_items"),
                             ("GET", "/v1/conversations/x"), ("DELETE", "/v1/conversations/x"),
                             ("GET", "/v1/conversations/x/items"), ("GET", "/v1/conversations/x/items/y")):
            _error(c.request(method, path), 404)
        _error(c.post("/v1/responses/x/tool_outputs", json={"tool_call_id": "a", "output": "b"}), 404)
        _error(c.post("/v1/conversations/x", json={"metadata": {}}), 404)


def test_snapshots_share_what_the_request_sent():
    """Each event's snapshot copies the output, not the request's text.format and tools."""
    from pagedllm.entrypoints.openai.responses_builder import ResponseBuilder

    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    text = {"format": {"type": "json_schema", "name": "s", "schema": schema}}
    builder = ResponseBuilder({"id": "resp_1", "status": "in_progress", "output": [], "text": text, "tools": []})
    snap = builder.snapshot()
    assert snap["text"] is text and snap["output"] == [] and snap["output"] is not builder.response["output"]
