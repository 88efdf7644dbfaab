"""LoRA adapters as served models over the scripted engine: `--lora-modules` parsed and registered
at start (ids 1, 2, ...), a request's `model` picking its adapter on every generating route,
/v1/models cards with parent and root, the runtime load / unload routes behind
PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING, their errors, and the LoRA gauges."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from pagedllm.config import LoRAConfig
from pagedllm.entrypoints.cli.main import build_parser
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.server_config import LoRAModulePath, ServerConfig, parse_lora_module
from pagedllm.entrypoints.openai.serving_models import RUNTIME_LORA_ENV
from pagedllm.lora_request import LoRARequest
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE
from tests.entrypoints.openai.fake_engine import FakeEngine

MSGS = [{"role": "user", "content": "Hello"}]
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def _adapter(root, name: str) -> str:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return str(path)


@pytest.fixture
def adapters(tmp_path) -> dict[str, str]:
    return {name: _adapter(tmp_path, name) for name in ("sql", "chat", "new")}


@pytest.fixture
def lora_engine(fake_tokenizer, fake_model_dir) -> FakeEngine:
    return FakeEngine(fake_tokenizer, fake_model_dir, lora_config=LoRAConfig(max_loras=2, max_cpu_loras=2))


def _client(engine, adapters: dict[str, str], **kw) -> TestClient:
    modules = (LoRAModulePath("sql", adapters["sql"]), LoRAModulePath("chat", adapters["chat"], "alias"))
    config = ServerConfig(served_model_names=("fake-model", "alias"), chat_template=CHAT_TEMPLATE,
                          lora_modules=modules, **kw)
    return TestClient(build_app(engine, config))


def _error(r, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and (param is None or error["param"] == param), error
    return error


def test_lora_modules_flag_both_forms():
    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    spec = parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "base"}')
    assert spec == LoRAModulePath("sql", "/a", "base")
    for bad in ("sql", "=/a", "sql=", '{"name": "x"}', '{"name": "x", "path": "/a", "rank": 8}', "{oops"):
        with pytest.raises(argparse.ArgumentTypeError, match="--lora-modules"):
            parse_lora_module(bad)
    args = build_parser().parse_args(["serve", "/m", "--enable-lora", "--lora-modules", "a=/p",
                                      '{"name": "b", "path": "/q"}'])
    assert ServerConfig.from_namespace(args).lora_modules == (LoRAModulePath("a", "/p"), LoRAModulePath("b", "/q"))
    without = build_parser().parse_args(["serve", "/m", "--lora-modules", "a=/p"])
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        ServerConfig.from_namespace(without)


def test_bad_lora_modules_fail_the_start(fake_engine, lora_engine, adapters, tmp_path):
    def app(engine, *modules):
        return build_app(engine, ServerConfig(served_model_names=("fake-model",), lora_modules=modules))

    with pytest.raises(ValueError, match="needs --enable-lora"):
        app(fake_engine, LoRAModulePath("sql", adapters["sql"]))
    with pytest.raises(ValueError, match="more than once"):
        app(lora_engine, LoRAModulePath("sql", adapters["sql"]), LoRAModulePath("sql", adapters["chat"]))
    with pytest.raises(ValueError, match="already a served model name"):
        app(lora_engine, LoRAModulePath("fake-model", adapters["sql"]))
    bad = app(lora_engine, LoRAModulePath("sql", adapters["sql"]), LoRAModulePath("bad", str(tmp_path / "none")))
    with pytest.raises(ValueError, match="--lora-modules bad: .*no adapter_config.json"):
        with TestClient(bad):
            pass


def test_models_list_and_cards(lora_engine, adapters):
    with _client(lora_engine, adapters) as c:
        assert sorted((r.lora_name, i) for i, r in lora_engine.loras.items()) == [("chat", 2), ("sql", 1)]
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert list(cards) == ["fake-model", "alias", "sql", "chat"]
        assert cards["fake-model"]["parent"] is None and cards["fake-model"]["root"] == "fake-model"
        assert (cards["sql"]["parent"], cards["sql"]["root"]) == ("fake-model", adapters["sql"])
        assert (cards["chat"]["parent"], cards["chat"]["root"]) == ("alias", adapters["chat"])
        assert cards["sql"]["max_model_len"] == cards["fake-model"]["max_model_len"]
        assert {**c.get("/v1/models/sql").json(), "created": 0} == {**cards["sql"], "created": 0}
        _error(c.get("/v1/models/nope"), 404, "model")


def test_model_picks_the_adapter_on_every_route(lora_engine, adapters):
    sql = LoRARequest("sql", 1, adapters["sql"])
    with _client(lora_engine, adapters) as c:
        for model, want in (("sql", sql), ("fake-model", None), ("alias", None), (None, None)):
            body = {"messages": MSGS, "max_tokens": 2} | ({"model": model} if model else {})
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["model"] == (model or "fake-model"), r.text
            assert lora_engine.calls[-1][5] == want
        r = c.post("/v1/completions", json={"model": "chat", "prompt": ["Hi", "Yo"], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "chat", r.text
        assert [call[5].lora_name for call in lora_engine.calls[-2:]] == ["chat", "chat"]
        r = c.post("/v1/completions", json={"model": "sql", "prompt": "Hi", "max_tokens": 2, "stream": True})
        assert r.status_code == 200 and lora_engine.calls[-1][5] == sql
        r = c.post("/v1/responses", json={"model": "sql", "input": "Hi", "max_output_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "sql" and lora_engine.calls[-1][5] == sql
        assert c.post("/tokenize", json={"model": "sql", "prompt": "Hi"}).status_code == 200
        calls = len(lora_engine.calls)
        for path, body in (("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "Hi"}),
                           ("/v1/responses", {"input": "Hi"})):
            _error(c.post(path, json={"model": "nope", **body}), 404, "model")
        assert len(lora_engine.calls) == calls


def test_runtime_routes_need_the_env_var(lora_engine, fake_engine, adapters, monkeypatch):
    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
    with _client(lora_engine, adapters) as c:
        _error(c.post(LOAD, json={"lora_name": "new", "lora_path": adapters["new"]}), 404)
        _error(c.post(UNLOAD, json={"lora_name": "sql"}), 404)
        assert LOAD not in c.get("/openapi.json").json()["paths"]
    monkeypatch.setenv(RUNTIME_LORA_ENV, "0")
    with _client(lora_engine, adapters) as c:
        _error(c.post(LOAD, json={"lora_name": "new", "lora_path": adapters["new"]}), 404)
    monkeypatch.setenv(RUNTIME_LORA_ENV, "true")
    plain = TestClient(build_app(fake_engine, ServerConfig(served_model_names=("fake-model",))))
    _error(plain.post(LOAD, json={"lora_name": "new", "lora_path": adapters["new"]}), 404)  # LoRA off: no routes


def test_load_and_unload_at_run_time(lora_engine, adapters, monkeypatch):
    monkeypatch.setenv(RUNTIME_LORA_ENV, "1")
    with _client(lora_engine, adapters) as c:
        doc = c.get("/openapi.json").json()["paths"]
        for path, codes in ((LOAD, {"200", "400", "401", "413", "503"}), (UNLOAD, {"200", "400", "401", "404", "413",
                                                                                   "503"})):
            op = doc[path]["post"]
            assert set(op["responses"]) == codes and "text/plain" in op["responses"]["200"]["content"]

        r = c.post(LOAD, json={"lora_name": "new", "lora_path": adapters["new"]})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'new' added successfully."
        assert lora_engine.loras[3] == LoRARequest("new", 3, adapters["new"])
        card = c.get("/v1/models/new").json()
        assert (card["parent"], card["root"]) == ("fake-model", adapters["new"])
        assert c.post("/v1/completions", json={"model": "new", "prompt": "Hi", "max_tokens": 1}).status_code == 200
        assert lora_engine.calls[-1][5].lora_int_id == 3

        msg = _error(c.post(LOAD, json={"lora_name": "new", "lora_path": adapters["sql"]}), 400, "lora_name")
        assert msg["message"] == "The LoRA adapter 'new' has already been loaded."
        _error(c.post(LOAD, json={"lora_name": "alias", "lora_path": adapters["sql"]}), 400, "lora_name")
        bad = _error(c.post(LOAD, json={"lora_name": "bad", "lora_path": "/no/such"}), 400, "lora_path")
        assert "no adapter_config.json" in bad["message"]
        _error(c.get("/v1/models/bad"), 404)
        for body in ({"lora_name": "x"}, {"lora_name": "", "lora_path": "/p"}, {"lora_name": 1, "lora_path": "/p"}):
            _error(c.post(LOAD, json=body), 400)

        r = c.post(UNLOAD, json={"lora_name": "new"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'new' removed successfully."
        assert lora_engine.removed_loras == [3] and 3 not in lora_engine.loras
        _error(c.post("/v1/completions", json={"model": "new", "prompt": "Hi"}), 404, "model")
        assert "new" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
        _error(c.post(UNLOAD, json={"lora_name": "new"}), 404, "lora_name")
        _error(c.post(UNLOAD, json={"lora_name": "sql", "lora_int_id": 2}), 404)  # name and id disagree
        _error(c.post(UNLOAD, json={}), 400)
        assert c.post(UNLOAD, json={"lora_int_id": 2}).status_code == 200  # "chat", by id
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["fake-model", "alias", "sql"]

        # A name loaded again gets a fresh id: the engine never sees one id with two paths.
        assert c.post(LOAD, json={"lora_name": "new", "lora_path": adapters["chat"]}).status_code == 200
        assert c.get("/v1/models/new").json()["root"] == adapters["chat"]
        assert max(lora_engine.loras) == 5  # 4 went to the bad adapter


class _LoRAStats:
    def __init__(self, stats: list[dict]) -> None:
        self.stats = stats

    async def get_engine_stats(self) -> list[dict]:
        return self.stats


def _series(text: str, name: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{")}


def test_lora_gauges():
    metrics = ServerMetrics("m")
    metrics.enable_lora(4, lambda: ["sql", "idle"])
    engine = _LoRAStats([{"num_running": 3, "lora_running:sql": 2, "lora_waiting:chat": 1},
                         {"lora_running:sql": 1, "lora_running:chat": 1}])
    asyncio.run(metrics.refresh(engine))
    text = metrics.render().decode()
    assert _series(text, "pagedllm:lora_requests_running") == {
        'pagedllm:lora_requests_running{lora_name="sql",model_name="m"}': 3.0,
        'pagedllm:lora_requests_running{lora_name="chat",model_name="m"}': 1.0,
        'pagedllm:lora_requests_running{lora_name="idle",model_name="m"}': 0.0}
    assert _series(text, "pagedllm:lora_requests_waiting")[
        'pagedllm:lora_requests_waiting{lora_name="chat",model_name="m"}'] == 1.0
    (info,) = _series(text, "pagedllm:lora_requests_info")
    assert info == ('pagedllm:lora_requests_info{max_lora="4",running_lora_adapters="chat,sql",'
                    'waiting_lora_adapters="chat"}')
    engine.stats = [{"num_running": 0}]  # every request finished: zeros, not the last counts
    asyncio.run(metrics.refresh(engine))
    text = metrics.render().decode()
    assert set(_series(text, "pagedllm:lora_requests_running").values()) == {0.0}
    assert set(_series(text, "pagedllm:lora_requests_waiting").values()) == {0.0}
    assert list(_series(text, "pagedllm:lora_requests_info")) == [
        'pagedllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""}']
    assert "lora" not in ServerMetrics("m").render().decode()  # LoRA off: no LoRA series


def test_metrics_route_with_lora(lora_engine, adapters):
    with _client(lora_engine, adapters) as c:
        assert c.post("/v1/completions", json={"model": "sql", "prompt": "Hi", "max_tokens": 1}).status_code == 200
        text = c.get("/metrics").text
        assert 'pagedllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in text
        for name in ("sql", "chat"):
            assert f'pagedllm:lora_requests_running{{lora_name="{name}",model_name="fake-model"}} 0.0' in text
