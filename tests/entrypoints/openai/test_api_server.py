"""The FastAPI app over a scripted engine: body and chunk shapes, error bodies and status
codes, auth, x-request-id, metrics, and aborts when the client goes away."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE

MSGS = [{"role": "user", "content": "Hello"}]
ERROR_KEYS = {"message", "type", "param", "code"}


def _args(**kw):
    base = dict(served_model_names=("fake-model",), chat_template=CHAT_TEMPLATE)
    return ServerConfig(**{**base, **kw})


@pytest.fixture
def client(fake_engine):
    return TestClient(build_app(fake_engine, _args()))


def _events(resp) -> list:
    lines = [line for line in resp.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS and body["error"]["code"] == status
    return body["error"]


def test_chat_completion_body(client, fake_engine):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == "fake-model"
    message = {"role": "assistant", "content": " w0 w1 w2", "reasoning_content": None, "tool_calls": []}
    assert body["choices"] == [{"index": 0, "message": message,
                                "logprobs": None, "finish_reason": "length", "stop_reason": None}]
    prompt, params, *_ = fake_engine.calls[0]
    assert prompt["prompt"] == "user: Hello\nassistant:"  # rendered with the server's template
    assert body["usage"] == {"prompt_tokens": len(prompt["prompt_token_ids"]), "completion_tokens": 3,
                             "total_tokens": len(prompt["prompt_token_ids"]) + 3,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert params.temperature == 0 and params.max_tokens == 3


def test_chat_stream_chunks(client):
    r = client.post("/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 3, "n": 2, "temperature": 1, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    for i in range(2):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == " w0 w1 w2"
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
        assert mine[-1]["delta"] == {"content": " w2"}  # finish_reason rides on the last content chunk
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert all("usage" not in e for e in events[:-1])


def test_chat_continuous_usage_and_logprobs(client):
    r = client.post("/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 2, "stream": True, "logprobs": True, "top_logprobs": 1,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = _events(r)
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [0, 1, 2]
    contents = [c for e in events[1:-1] for c in e["choices"][0]["logprobs"]["content"]]
    assert [c["token"] for c in contents] == [" w0", " w1"]
    assert contents[0]["top_logprobs"] == [{"token": " w0", "logprob": -0.5, "bytes": list(b" w0")}]


def test_completions_multiple_prompts_index_prompt_major(client):
    r = client.post("/v1/completions", json={"prompt": ["a b", "c"], "n": 2, "max_tokens": 2, "temperature": 1,
                                              "echo": True, "logprobs": 1})
    body = r.json()
    assert body["object"] == "text_completion" and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["a b w0 w1"] * 2 + ["c w0 w1"] * 2
    lp = body["choices"][2]["logprobs"]
    assert lp["tokens"][-2:] == [" w0", " w1"] and lp["token_logprobs"][0] is None
    assert lp["text_offset"][-2:] == [1, 4]  # offsets index into the echoed text


def test_completions_stream(client):
    r = client.post("/v1/completions", json={"prompt": [[5, 6], [7]], "max_tokens": 2, "stream": True,
                                              "stream_options": {"include_usage": True}})
    events = _events(r)
    for i in range(2):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == " w0 w1" and mine[-1]["finish_reason"] == "length"
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/chat/completions", {"messages": MSGS, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "'system', 'user'"),
    ("/v1/chat/completions", {"messages": MSGS, "top_p": 5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 500}, 400, "maximum context length is 64"),
    ("/v1/chat/completions", {"messages": MSGS, "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/chat/completions", {"messages": MSGS, "tool_choice": "auto"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": MSGS, "stream_options": {"include_usage": True}}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix is not supported"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1000]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": [1000], "stream": True}, 400, "vocabulary"),  # a 400, not a 200 stream
    ("/v1/completions", {"prompt": 3}, 400, "prompt"),
])
def test_errors_are_openai_bodies(client, path, body, status, needle):
    err = _error(client.post(path, json=body), status)
    assert needle in err["message"] or needle == err["param"], err


def test_route_and_json_errors(client):
    _error(client.get("/v1/nothing"), 404)
    _error(client.get("/v1/completions"), 405)
    err = _error(client.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]


BIG = 2**63


@pytest.mark.parametrize("path, body, param", [
    # token ids: negative, >= 2^63, >= the vocabulary, wrong type, in every field that takes them
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": [BIG]}, "prompt"),
    ("/v1/completions", {"prompt": [5, 2**32]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [BIG + 5]]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [-3]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, "5"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2.0]}, "prompt"),
    ("/v1/completions", {"stop_token_ids": [BIG]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ("/v1/completions", {"stop_token_ids": ["5"]}, "stop_token_ids.0"),
    ("/v1/completions", {"allowed_token_ids": [384]}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [-1]}, "allowed_token_ids.0"),
    ("/v1/completions", {"logit_bias": {str(BIG): 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"1" * 5000: 1}}, "logit_bias"),  # int() refuses > 4300 digits
    ("/v1/chat/completions", {"logit_bias": {"384": 1}}, "logit_bias"),
    ("/detokenize", {"tokens": [BIG]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": ["5"]}, "tokens.0"),
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
    # a lone surrogate (not valid UTF-8) in any text
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt.1"),
    ("/v1/completions", {"stop": "\ud800"}, "stop"),
    ("/v1/completions", {"bad_words": ["\ud800"]}, "bad_words.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "\ud800"}}]},
     "tools.0.function.name"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    # wrong types
    ("/v1/chat/completions", {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, "messages.0.role"),
    ("/v1/completions", {"max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {"echo": 1}, "echo"),
    ("/v1/completions", {"temperature": []}, "temperature"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    # NaN and ±Infinity, in typed fields and anywhere else in the body
    ("/v1/completions", {"temperature": float("nan")}, "temperature"),
    ("/v1/chat/completions", {"temperature": float("inf")}, "temperature"),
    ("/v1/completions", {"top_p": float("-inf")}, "top_p"),
    ("/v1/completions", {"presence_penalty": float("nan")}, "presence_penalty"),
    ("/v1/completions", {"repetition_penalty": float("inf")}, "repetition_penalty"),
    ("/v1/completions", {"logit_bias": {"5": float("nan")}}, "logit_bias.5"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"schema": {"maximum": float("inf")}}}},
     "response_format.json_schema.schema.maximum"),
    ("/v1/completions", {"some_unknown_field": float("nan")}, "some_unknown_field"),
])
def test_hostile_input_is_400_and_never_reaches_the_engine(client, fake_engine, path, body, param):
    base = {"messages": MSGS, "max_tokens": 2} if path == "/v1/chat/completions" else (
        {"prompt": "Hello", "max_tokens": 2} if path == "/v1/completions" else {})
    # Python's json writes NaN / Infinity and keeps \ud800 escaped, as a hostile client's would.
    content = json.dumps({**base, **body})
    err = _error(client.post(path, content=content, headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert fake_engine.calls == []


def test_openapi_document_states_the_real_status_codes(client):
    doc = client.get("/openapi.json").json()
    for path, item in doc["paths"].items():
        for method, op in item.items():
            codes = set(op["responses"])
            assert "422" not in codes, (method, path)
            assert ("401" in codes) == (path != "/health"), (method, path)
            if method == "post":
                assert {"200", "400", "401", "413"} <= codes, (method, path)
            for code in codes - {"200"}:
                ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorResponse", (method, path, code)
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert set(doc["paths"][path]["post"]["responses"]["200"]["content"]) == {"application/json",
                                                                                 "text/event-stream"}
    assert {"HTTPValidationError", "ValidationError"}.isdisjoint(doc["components"]["schemas"])
    role = doc["components"]["schemas"]["ChatMessageParam"]["properties"]["role"]
    assert set(role["enum"]) == {"system", "user", "assistant", "tool", "developer"}


def test_developer_role_renders_as_system(client, fake_engine):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "developer", "content": "Be brief."}, *MSGS],
                                                  "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert fake_engine.calls[0][0]["prompt"] == "system: Be brief.\nuser: Hello\nassistant:"


def test_api_key_on_every_route_but_health(fake_engine):
    client = TestClient(build_app(fake_engine, _args(api_key="sekrit")))
    err = _error(client.get("/v1/models"), 401)
    assert err["type"] == "authentication_error"
    _error(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    _error(client.get("/v1/models", headers={"Authorization": "Basic sekrit"}), 401)
    _error(client.get("/v1/models", headers={"Authorization": "sekrit"}), 401)
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert client.get("/v1/models", headers={"Authorization": f"{scheme} sekrit"}).status_code == 200
    assert client.get("/health").status_code == 200
    for method, path, body in (("get", "/metrics", None), ("get", "/version", None), ("get", "/docs", None),
                               ("get", "/openapi.json", None), ("post", "/tokenize", {"prompt": "hi"}),
                               ("post", "/detokenize", {"tokens": [1]}), ("get", "/nothing", None)):
        _error(client.request(method, path, json=body), 401)
        ok = client.request(method, path, json=body, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == (404 if path == "/nothing" else 200), (path, ok.text)
    opened = TestClient(build_app(fake_engine, _args(api_key="sekrit", metrics_no_auth=True)))
    assert opened.get("/metrics").status_code == 200
    _error(opened.get("/version"), 401)


def test_request_id_header_and_cors(fake_engine):
    client = TestClient(build_app(fake_engine, _args(allowed_origins=("http://a.example",))))
    assert client.get("/health", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
    generated = client.get("/v1/nothing").headers["x-request-id"]
    assert len(generated) == 32
    r = client.options("/v1/models", headers={"Origin": "http://a.example", "Access-Control-Request-Method": "GET"})
    assert r.headers["access-control-allow-origin"] == "http://a.example" and "x-request-id" in r.headers


def test_models_version_tokenize(client, fake_tokenizer):
    models = client.get("/v1/models").json()
    card = models["data"][0]
    assert models["object"] == "list" and card["id"] == "fake-model" and card["owned_by"] == "pagedllm"
    assert card["max_model_len"] == 64 and card["root"]
    assert client.get("/version").json()["version"]
    tok = client.post("/tokenize", json={"prompt": "Hello there"}).json()
    assert tok["tokens"] == fake_tokenizer("Hello there").input_ids and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 64
    chat = client.post("/tokenize", json={"messages": MSGS}).json()
    assert chat["tokens"] == fake_tokenizer("user: Hello\nassistant:").input_ids
    assert client.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello there"}
    _error(client.post("/detokenize", json={"tokens": [10**6]}), 400)
    _error(client.post("/tokenize", json={}), 400)


def test_model_retrieve_by_id_with_slashes(fake_engine):
    client = TestClient(build_app(fake_engine, _args(served_model_names=("org/fake-model", "b"))))
    listed = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    for name in ("org/fake-model", "b"):
        card = client.get(f"/v1/models/{name}").json()
        assert card == {**listed[name], "created": card["created"]} and card["object"] == "model"
    for unknown in ("fake-model", "org", "org/fake-model/x", ""):
        err = _error(client.get(f"/v1/models/{unknown}"), 404)
        assert err["type"] == "not_found_error"


def test_tokenizer_info_needs_its_flag_and_shows_no_server_paths(fake_model_dir):
    from transformers import AutoTokenizer

    from tests.entrypoints.openai.fake_engine import FakeEngine

    tok = AutoTokenizer.from_pretrained(fake_model_dir)  # its own copy: init_kwargs change below
    tok.init_kwargs.update({
        "vocab_file": f"{fake_model_dir}/vocab.json", "tokenizer_file": f"{fake_model_dir}/tokenizer.json",
        "special_tokens_map_file": "/etc/special_tokens_map.json", "cache_dir": "/root/.cache/hf",
        "auto_map": {"AutoTokenizer": [f"{fake_model_dir}/tokenization_x.py", None]},
        "sp_model_kwargs": {"model": "/opt/models/sp.model", "enable_sampling": False},
        "extra_special_tokens": {"image_token": "<img>"}, "clean_up_tokenization_spaces": False,
        "unserialisable": object(), "nan": float("nan"),
    })
    engine = FakeEngine(tok, fake_model_dir)
    _error(TestClient(build_app(engine, _args())).get("/tokenizer_info"), 404)  # off by default, as in vLLM
    client = TestClient(build_app(engine, _args(enable_tokenizer_info_endpoint=True, api_key="k")))
    _error(client.get("/tokenizer_info"), 401)
    r = client.get("/tokenizer_info", headers={"Authorization": "Bearer k"})
    info = r.json()
    # What lm-eval's RemoteTokenizer reads, and vLLM's fields.
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("</s>", "<s>", "<pad>")
    assert info["tokenizer_class"] == type(tok).__name__ and info["model_max_length"] == 64
    assert info["chat_template"] == CHAT_TEMPLATE  # the one chat completions use
    assert info["added_tokens_decoder"]["1"] == "<s>" and info["extra_special_tokens"] == {"image_token": "<img>"}
    assert info["clean_up_tokenization_spaces"] is False and info["sp_model_kwargs"] == {"enable_sampling": False}
    assert info["auto_map"] == {"AutoTokenizer": [None]}
    for gone in ("vocab_file", "tokenizer_file", "special_tokens_map_file", "cache_dir", "name_or_path",
                 "unserialisable", "nan"):
        assert gone not in info
    for secret in (fake_model_dir, "/etc/", "/root/", "/opt/"):
        assert secret not in r.text


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(client, fake_engine):
    body = {"prompt": ["a b", "c"], "max_tokens": 0, "echo": True, "logprobs": 1}
    r = client.post("/v1/completions", json=body).json()
    assert [c["text"] for c in r["choices"]] == ["a b", "c"]
    assert [c["finish_reason"] for c in r["choices"]] == ["length", "length"]
    assert r["choices"][0]["logprobs"]["tokens"] == ["a", " b"] and r["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == 3
    params = fake_engine.calls[0][1]  # one engine step, its token dropped; the prompt's logprobs
    assert (params.max_tokens, params.prompt_logprobs, params.logprobs) == (1, 1, None)
    events = _events(client.post("/v1/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}))
    streamed = sorted((e["choices"][0] for e in events[:-1]), key=lambda c: c["index"])
    assert streamed == [_without(c, "prompt_logprobs") for c in r["choices"]]  # one chunk per choice
    assert events[-1]["usage"] == r["usage"]


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"max_tokens": 0, "stream": True}, "max_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
])
def test_max_tokens_zero_without_echo_is_400(client, fake_engine, body, param):
    err = _error(client.post("/v1/completions", json={"prompt": "a", **body}), 400)
    assert err["param"] == param and not fake_engine.calls


def test_dead_engine_is_503(client, fake_engine):
    fake_engine.errored = True
    _error(client.get("/health"), 503)
    err = _error(client.post("/v1/chat/completions", json={"messages": MSGS}), 503)
    assert "engine" in err["message"]
    assert client.get("/metrics").status_code == 200  # still scrapeable


def test_metrics(client):
    client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
    text = client.get("/metrics").text
    for line in ['pagedllm:prompt_tokens_total{model_name="fake-model"} 3.0',
                 'pagedllm:generation_tokens_total{model_name="fake-model"} 3.0',
                 'pagedllm:request_success_total{finished_reason="length",model_name="fake-model"} 1.0',
                 'pagedllm:time_to_first_token_seconds_count{model_name="fake-model"} 1.0',
                 'pagedllm:e2e_request_latency_seconds_count{model_name="fake-model"} 1.0',
                 'pagedllm:time_per_output_token_seconds_count{model_name="fake-model"} 1.0',
                 'pagedllm:prefix_cache_hits_total{engine="0",model_name="fake-model"} 4.0',
                 'pagedllm:num_preemptions_total{engine="0",model_name="fake-model"} 1.0',
                 'pagedllm:num_requests_running{engine="0",model_name="fake-model"} 0.0',
                 'pagedllm:kv_cache_usage_perc{engine="0",model_name="fake-model"} 0.0']:
        assert line in text, line


async def _call_until_disconnect(app, path: str, body: dict, disconnect_after: float) -> list[dict]:
    """Drive the ASGI app directly; the client hangs up `disconnect_after` seconds in."""
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("t", 1),
             "server": ("t", 80)}
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_request(fake_tokenizer, fake_model_dir, stream):
    from tests.entrypoints.openai.fake_engine import FakeEngine

    engine = FakeEngine(fake_tokenizer, fake_model_dir, step_delay=0.02)
    app = build_app(engine, _args())
    body = {"prompt": ["a", "b"], "max_tokens": 40, "stream": stream}
    sent = asyncio.run(_call_until_disconnect(app, "/v1/completions", body, disconnect_after=0.15))
    assert engine.live == set()  # both prompts' requests ended...
    assert sorted(set(engine.aborted)) == sorted(c[2] for c in engine.calls)  # ...by an abort
    if stream:
        assert sent[0]["status"] == 200 and any(m.get("body") for m in sent[1:])


def test_serve_cli_flags(monkeypatch):
    from pagedllm.entrypoints.cli.engine_args import engine_args_from_namespace
    from pagedllm.entrypoints.cli.main import build_parser
    from pagedllm.entrypoints.openai.api_server import _origins

    ns = build_parser().parse_args([
        "serve", "/m", "--host", "127.0.0.1", "--port", "9", "--served-model-name", "a", "b", "--max-model-len", "128",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--max-n", "16", "--kv-cache-memory", "16MiB",
        "--no-enable-prefix-caching", "--chat-template", "t.jinja", "--dtype", "float32", "--seed", "3",
        "--uvicorn-log-level", "warning", "--allowed-origins", "http://x", "--api-key", "k"])
    assert (ns.host, ns.port, ns.served_model_names, ns.chat_template, ns.uvicorn_log_level, ns.api_key) == (
        "127.0.0.1", 9, ["a", "b"], "t.jinja", "warning", "k")
    ea = engine_args_from_namespace(ns)
    assert (ea.model, ea.max_model_len, ea.max_num_seqs, ea.max_num_batched_tokens, ea.kv_cache_memory) == (
        "/m", 128, 4, 256, 16 << 20)
    assert not ea.enable_prefix_caching and ea.dtype == "float32" and ea.seed == 3 and ea.max_n == 16
    assert _origins(['["*"]']) == ["*"] and _origins(["a,b", "c"]) == ["a", "b", "c"]


def test_api_key_falls_back_to_env(monkeypatch):
    import pagedllm.entrypoints.cli.serve as serve
    from pagedllm.entrypoints.cli.main import build_parser

    seen = {}

    async def fake_serve(args):
        seen["key"] = args.api_key
        return 0

    monkeypatch.setattr(serve, "_serve", fake_serve)
    monkeypatch.setattr(serve.signal, "signal", lambda *a: None)
    monkeypatch.setenv("PAGEDLLM_API_KEY", "from-env")
    assert serve.run_serve(build_parser().parse_args(["serve", "/m"])) == 0 and seen["key"] == "from-env"
    serve.run_serve(build_parser().parse_args(["serve", "/m", "--api-key", "flag"]))
    assert seen["key"] == "flag"


def test_auto_tool_choice_lets_the_parser_adjust_the_request(fake_engine):
    """Mistral's [TOOL_CALLS] is a special token: with its parser, special tokens stay in the text."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    app = build_app(fake_engine, _args(enable_auto_tool_choice=True, tool_call_parser="mistral"))
    r = TestClient(app).post("/v1/chat/completions", json={"messages": MSGS, "tools": tools, "max_tokens": 2})
    assert r.status_code == 200, r.text
    _, params, *_ = fake_engine.calls[-1]
    assert params.skip_special_tokens is False
    r = TestClient(app).post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
    _, params, *_ = fake_engine.calls[-1]
    assert params.skip_special_tokens is True  # no tools: untouched


def test_embeddings_on_a_generation_server_say_how_to_start_a_pooling_one(client):
    err = _error(client.post("/v1/embeddings", json={"input": "hi"}), 400)
    assert "--runner pooling" in err["message"] and err["param"] == "model"
