"""The HTTP surface around the routes: what a client without the key learns (nothing: 401 before
routing, OPTIONS included), probes by HEAD, the Allow header of a 405, and how long a request id
may be."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.protocol import MAX_REQUEST_ID_CHARS
from pagedllm.entrypoints.openai.server_config import ServerConfig
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSGS = [{"role": "user", "content": "Hello"}]


def _client(engine, **kw) -> TestClient:
    return TestClient(build_app(engine, ServerConfig(served_model_names=("fake-model",), chat_template=CHAT_TEMPLATE,
                                                     **kw)))


def _error(resp, status: int, needle: str = "") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == status and needle in err["message"], err
    return err


def test_options_without_the_key_cannot_list_routes(fake_engine):
    client = _client(fake_engine, api_key=KEY)
    for path in ("/v1/models", "/v1/chat/completions", "/v1/load_lora_adapter", "/no/such/route"):
        r = client.options(path)
        _error(r, 401)
        assert "allow" not in r.headers
    assert client.options("/v1/chat/completions", headers=AUTH).status_code == 405  # with the key: routing


def test_cors_preflight_still_answered_without_the_key(fake_engine):
    client = _client(fake_engine, api_key=KEY, allowed_origins=("http://a.example",))
    r = client.options("/v1/models", headers={"Origin": "http://a.example", "Access-Control-Request-Method": "GET"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://a.example"


def test_head_health_for_probes(fake_engine):
    client = _client(fake_engine, api_key=KEY)
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b""
    fake_engine.errored = True
    assert client.head("/health").status_code == 503


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("POST", "/health", "GET, HEAD"),
    ("GET", "/v1/chat/completions", "POST"),
    ("PUT", "/v1/responses/resp_1", "DELETE, GET"),
    ("PATCH", "/v1/conversations/conv_1", "DELETE, GET, POST"),
    ("DELETE", "/v1/conversations/conv_1/items", "GET, POST"),
])
def test_405_allow_lists_every_method_of_the_path(fake_engine, method, path, allow):
    r = _client(fake_engine).request(method, path)
    _error(r, 405, f"Method {method} not allowed")
    assert r.headers["allow"] == allow


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_request_id_is_capped(fake_engine, route):
    client = _client(fake_engine)
    body = {"messages": MSGS, "prompt": "Hi", "max_tokens": 1}
    err = _error(client.post(route, json={**body, "request_id": "x" * 1_000_000}), 400,
                 f"at most {MAX_REQUEST_ID_CHARS} characters")
    assert err["param"] == "request_id" and fake_engine.calls == []
    r = client.post(route, json={**body, "request_id": "x" * MAX_REQUEST_ID_CHARS})
    assert r.status_code == 200 and r.json()["id"].endswith("x" * MAX_REQUEST_ID_CHARS)


def test_request_id_header_is_capped(fake_engine):
    client = _client(fake_engine)
    r = client.get("/health", headers={"x-request-id": "y" * (MAX_REQUEST_ID_CHARS + 1)})
    _error(r, 400, f"longer than {MAX_REQUEST_ID_CHARS} characters")
    assert len(r.headers["x-request-id"]) == 32  # a fresh id, not the client's echoed back
    ok = "y" * MAX_REQUEST_ID_CHARS
    assert client.get("/health", headers={"x-request-id": ok}).headers["x-request-id"] == ok
