"""/dashboard over the scripted engine: the page and its script load without the key, the JSON
state needs it, and carries the engine stats, the per-core block maps and the token counters."""

from __future__ import annotations

from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE
from tests.entrypoints.openai.fake_engine import FAKE_NUM_BLOCKS

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _client(engine, **kw) -> TestClient:
    config = ServerConfig(served_model_names=("fake-model",), chat_template=CHAT_TEMPLATE, **kw)
    return TestClient(build_app(engine, config))


def test_page_and_script_load_without_the_key(fake_engine):
    client = _client(fake_engine, api_key=KEY)
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="dashboard/dashboard.js"' in page.text and "<svg" in page.text
    assert "http://" not in page.text.replace('"http://www.w3.org/2000/svg"', "")  # nothing from a CDN
    script = client.get("/dashboard/dashboard.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "dashboard/state" in script.text and "Authorization" in script.text and "sessionStorage" in script.text


def test_page_script_and_state_send_the_browser_security_headers(fake_engine):
    """The page may run only its own script and fetch only this server, and cannot be framed."""
    client = _client(fake_engine)
    for path in ("/dashboard", "/dashboard/dashboard.js", "/dashboard/state"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["x-content-type-options"] == "nosniff", path
        assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store", path
        csp = dict(part.strip().split(" ", 1) for part in r.headers["content-security-policy"].split(";"))
        assert csp["default-src"] == "'none'" and csp["frame-ancestors"] == "'none'", path
        assert csp["script-src"] == "'self'" and csp["connect-src"] == "'self'", path
    assert "<script>" not in client.get("/dashboard").text  # no inline script for 'self' to block


def test_state_requires_the_key(fake_engine):
    client = _client(fake_engine, api_key=KEY)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = client.get("/dashboard/state", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == 401
    assert client.get("/dashboard/state", headers=AUTH).status_code == 200
    assert client.get("/dashboard/other").status_code == 401  # only the two static files are open


def test_state_shape_and_counters(fake_engine):
    client = _client(fake_engine)
    before = client.get("/dashboard/state").json()
    assert before["model"] == "fake-model" and before["prompt_tokens"] == before["generation_tokens"] == 0
    r = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    state = client.get("/dashboard/state").json()
    assert set(state) == {"timestamp", "model", "prompt_tokens", "generation_tokens", "stats", "engines"}
    assert state["timestamp"] >= before["timestamp"]
    assert state["prompt_tokens"] == usage["prompt_tokens"] and state["generation_tokens"] == 3
    assert state["stats"]["prefix_cache_hit_rate"] == 0.4
    (core,) = state["engines"]
    assert core["num_blocks"] == FAKE_NUM_BLOCKS == len(core["block_states"]) and not core["blocks_truncated"]
    assert set(core["block_states"]) <= {"f", "u", "c"} and core["stats"]["num_running"] == 0
    assert core["requests"] == []


def test_state_documented_page_not(fake_engine):
    doc = _client(fake_engine).get("/openapi.json").json()
    assert "/dashboard" not in doc["paths"] and "/dashboard/dashboard.js" not in doc["paths"]
    assert set(doc["paths"]["/dashboard/state"]["get"]["responses"]) == {"200", "401", "503"}


def test_dead_engine_is_503(fake_engine):
    fake_engine.errored = True
    r = _client(fake_engine).get("/dashboard/state")
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
