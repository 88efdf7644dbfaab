"""What a hostile client cannot do: read files through chat_template, run a template the
operator did not allow, stall the event loop, or send an unbounded body."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE

MSGS = [{"role": "user", "content": "Hello"}]
SLOW_TEMPLATE = ("{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}"
                 "{% endfor %}{% endfor %}{% endfor %}")


def _app(engine, **kw):
    base = dict(served_model_names=("fake-model",), chat_template=CHAT_TEMPLATE)
    return build_app(engine, ServerConfig(**{**base, **kw}))


def _error(resp, status: int, needle: str = "") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == status and needle in err["message"], err
    return err


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("{{ 'top secret' }}")  # even a file that *is* a template is never read
    return str(path)


@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions"])
def test_request_chat_template_refused_by_default(fake_engine, secret_file, route):
    client = TestClient(_app(fake_engine))
    for template in (secret_file, "/proc/self/cmdline", "/etc/passwd", "{{ 'inline' }}"):
        body = {"messages": MSGS, "chat_template": template, "return_token_strs": True, "max_tokens": 2}
        _error(client.post(route, json=body), 400, "--trust-request-chat-template")
    assert fake_engine.calls == []


def test_trusted_request_template_is_text_never_a_path(fake_engine, fake_tokenizer, secret_file):
    client = TestClient(_app(fake_engine, trust_request_chat_template=True))
    for path in (secret_file, "/proc/self/environ", "/etc/passwd"):
        _error(client.post("/tokenize", json={"messages": MSGS, "chat_template": path}), 400)
    r = client.post("/tokenize", json={"messages": MSGS, "chat_template": "{{ messages[0]['content'] }}!"})
    assert r.status_code == 200 and r.json()["tokens"] == fake_tokenizer("Hello!").input_ids


@pytest.mark.parametrize("template", ["{{ 1/0 }}", "{{ raise_exception('bad') }}", "{{ x }", '{{ "a" * 10**10 }}',
                                      "{{ ''.__class__.__mro__ }}"])
def test_failing_templates_are_400(fake_engine, template):
    client = TestClient(_app(fake_engine, trust_request_chat_template=True))
    for route in ("/tokenize", "/v1/chat/completions"):
        _error(client.post(route, json={"messages": MSGS, "chat_template": template, "max_tokens": 2}), 400)


@pytest.mark.parametrize("kwargs", [[1, 2], "x", 5])
def test_chat_template_kwargs_of_the_wrong_type_is_400(fake_engine, kwargs):
    client = TestClient(_app(fake_engine))
    for route in ("/tokenize", "/v1/chat/completions"):
        resp = client.post(route, json={"messages": MSGS, "chat_template_kwargs": kwargs, "max_tokens": 2})
        assert resp.status_code == 400, resp.text


def test_health_answers_while_a_template_renders(fake_engine):
    """A template that runs to its time limit renders in a worker thread: the loop stays free."""
    with TestClient(_app(fake_engine, trust_request_chat_template=True)) as client:
        result = {}

        def hostile():
            t0 = time.monotonic()
            result["resp"] = client.post("/v1/chat/completions",
                                         json={"messages": MSGS, "chat_template": SLOW_TEMPLATE, "max_tokens": 2})
            result["took"] = time.monotonic() - t0

        t = threading.Thread(target=hostile)
        t.start()
        time.sleep(0.3)
        worst = 0.0
        while t.is_alive():
            t0 = time.monotonic()
            assert client.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.1)
        t.join()
        assert worst < 1.0
        assert result["took"] > 1.0  # it really was rendering while /health answered
        _error(result["resp"], 400, "too long")


def test_prompt_that_cannot_fit_is_rejected_before_tokenizing(fake_engine, monkeypatch):
    client = TestClient(_app(fake_engine))
    calls = []
    real = fake_engine.tokenizer.__class__.__call__

    def counting(self, text, *a, **k):
        calls.append(len(text) if isinstance(text, str) else 0)
        return real(self, text, *a, **k)

    monkeypatch.setattr(fake_engine.tokenizer.__class__, "__call__", counting)
    huge = "word " * 400_000  # 2 MB: cannot be under 64 tokens
    _error(client.post("/v1/completions", json={"prompt": huge, "max_tokens": 2}), 400, "maximum context length")
    _error(client.post("/tokenize", json={"prompt": huge}), 400, "maximum context length")
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}]}), 400)
    assert all(n < 100_000 for n in calls)


def test_body_size_limit_is_413_before_parsing(fake_engine):
    client = TestClient(_app(fake_engine, max_request_body_bytes=10_000))
    big = {"prompt": "x" * 20_000, "max_tokens": 2}
    _error(client.post("/v1/completions", json=big), 413, "larger than 10000 bytes")

    def chunks():  # no Content-Length: counted as it streams in
        for _ in range(30):
            yield b"x" * 1000

    _error(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert fake_engine.calls and all(len(c[0]["prompt"]) < 100 for c in fake_engine.calls)


# ---- nesting: a 400 naming the limit, never a RecursionError's 500 ---------------------------------------------------

def _object_schema(depth: int) -> str:
    """A schema of `depth` objects one inside the other: two JSON levels each."""
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def _any_of(depth: int) -> str:
    return '{"anyOf":[' * depth + '{"type":"string"}' + "]}" * depth


def _arrays(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


def _post_raw(client, path: str, body: str):
    return client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "template"), [
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2,'
                             '"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":%s}}}'),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2,"tools":[{"type":"function",'
                             '"function":{"name":"f","parameters":%s}}]}'),
    ("/v1/completions", '{"prompt":"Hi","max_tokens":2,"structured_outputs":{"json":%s}}'),
    ("/v1/responses", '{"input":"Hi","max_output_tokens":2,"text":{"format":{"type":"json_schema","name":"x",'
                      '"schema":%s}}}'),
    ("/v1/responses", '{"input":"Hi","max_output_tokens":2,"tools":[{"type":"function","name":"f","parameters":%s}]}'),
])
@pytest.mark.parametrize("schema", [_object_schema(300), _any_of(600), _arrays(900), _object_schema(20_000)])
def test_deeply_nested_bodies_are_400_naming_the_limit(fake_engine, path, template, schema):
    client = TestClient(_app(fake_engine), raise_server_exceptions=False)
    t0 = time.monotonic()
    _error(_post_raw(client, path, template % schema), 400, "nested more than 64 levels deep")
    # Loose: the first request also starts the app, and the suite shares two cores.
    assert time.monotonic() - t0 < 5.0 and fake_engine.calls == []


def test_nesting_real_schemas_need_passes(fake_engine):
    """Eleven objects one inside the other, each an array's items under anyOf (five levels each):
    with the body, tools, the tool and its function around it, 60 levels; 64 pass, 65 do not."""
    schema = '{"anyOf":[{"type":"array","items":{"type":"object","properties":{"a":' * 11 + '{"type":"string"}'
    schema += "}}}]}" * 11
    client = TestClient(_app(fake_engine))
    for wrappers, status in ((0, 200), (4, 200), (5, 400)):
        parameters = '{"type":"array","items":' * wrappers + schema + "}" * wrappers
        body = ('{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2,"tool_choice":"none",'
                '"tools":[{"type":"function","function":{"name":"f","parameters":' + parameters + "}}]}")
        assert _post_raw(client, "/v1/chat/completions", body).status_code == status, wrappers


def test_a_body_too_deep_for_the_json_parser_is_400_naming_the_limit(fake_engine):
    client = TestClient(_app(fake_engine), raise_server_exceptions=False)
    body = '{"prompt":"Hi","x":' + "[" * 100_000 + "]" * 100_000 + "}"
    _error(_post_raw(client, "/v1/completions", body), 400, "nested more than 64 levels deep")


@pytest.mark.parametrize(("template", "needle"), [
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "brackets more than 16 levels deep"),
    ("{{ " + "[" * 17 + "1" + "]" * 17 + " }}", "brackets more than 16 levels deep"),
    ("{% if 1 %}" * 2000 + "x" + "{% endif %}" * 2000, "blocks more than 16 levels deep"),
    ("{%- for a in [1] %}" * 17 + "x" + "{% endfor -%}" * 17, "blocks more than 16 levels deep"),
    ("{{ " + "1 + " * 3000 + "1 }}", "does not compile"),
    ("{{ " + "not " * 3000 + "1 }}", "does not compile"),
])
def test_deeply_nested_templates_are_400(fake_engine, template, needle):
    client = TestClient(_app(fake_engine, trust_request_chat_template=True), raise_server_exceptions=False)
    for route in ("/tokenize", "/v1/chat/completions"):
        _error(client.post(route, json={"messages": MSGS, "chat_template": template, "max_tokens": 2}), 400, needle)
    nested = "{% if 1 %}" * 16 + "{{ " + "(" * 16 + "'ok'" + ")" * 16 + " }}" + "{% endif %}" * 16
    r = client.post("/tokenize", json={"messages": MSGS, "chat_template": nested, "return_token_strs": True})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("template", "needle"), [
    ('{% set ns = namespace(x="ab") %}{% for i in range(28) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}',
     "concatenation (~) larger than"),
    ('{% set s = "a" * 1000 %}{{ ([s] * 64) | join }}', "join larger than"),
    ('{% set s = "a" * 1000 %}{{ s.replace("a", "b" * 64) }}', "replacement larger than"),
    ("{{ 1 }}" + " " * 64 * 1024, "more than the limit of 65536"),
])
def test_template_size_limits_are_400_at_the_defaults(fake_engine, template, needle):
    client = TestClient(_app(fake_engine, trust_request_chat_template=True), raise_server_exceptions=False)
    for route in ("/tokenize", "/v1/chat/completions"):
        _error(client.post(route, json={"messages": MSGS, "chat_template": template, "max_tokens": 2}), 400, needle)
