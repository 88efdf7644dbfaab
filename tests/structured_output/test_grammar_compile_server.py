"""Grammar compilation cannot jam `pagedllm serve`: every size limit is a 400 naming the limit;
a small schema is answered in under 2 s while a large one compiles; the large one fails with
the time-limit error instead of hanging; a client that disconnects takes its compile with it."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny
from tests.structured_output.test_grammar_compile_jam import big, small
from tests.structured_output.test_grammar_limits import OVER_LIMITS

MSGS = [{"role": "user", "content": "Hi"}]
TIMEOUT_S = 5


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    """(URL, server process)."""
    procs: list = []
    env = {"OMP_NUM_THREADS": "1", "PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT_S": str(TIMEOUT_S)}
    for url in serve_tiny(tiny_llama, tmp_path_factory, procs=procs, env=env):
        yield url, procs[0]


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[0]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _so(params) -> dict:
    return {k: v for k, v in vars(params).items() if v not in (None, False)}


def _chat(client, so: dict, max_tokens: int = 16):
    return client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=max_tokens, temperature=0,
                                          extra_body={"structured_outputs": so})


@pytest.mark.parametrize("spec, name", OVER_LIMITS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(OVER_LIMITS)])
def test_each_limit_is_400(client, spec, name):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, spec)
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    assert f"({name})" in e.value.body["message"], e.value.body


def test_limit_via_response_format_and_guided_choice_is_400(client):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}
    with pytest.raises(openai.BadRequestError, match="MAX_PROPERTIES"):
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    with pytest.raises(openai.BadRequestError, match="MAX_CHOICES"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"guided_choice": [str(i) for i in range(100_000)]})


def _warm_up(client) -> None:
    """Two distinct specs at once: both compiler processes have started."""
    threads = [threading.Thread(target=_chat, args=(client, {"choice": [f"w{i}", "x"]})) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_small_schema_answered_while_a_large_one_compiles(client):
    _warm_up(client)
    result: dict = {}

    def send_big() -> None:
        start = time.monotonic()
        try:
            result["big"] = _chat(client, _so(big("srv")))
        except openai.APIError as e:
            result["big"] = e
        result["big_s"] = time.monotonic() - start

    thread = threading.Thread(target=send_big)
    thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    resp = _chat(client, {**_so(small("srv_small")), "disable_any_whitespace": True}, max_tokens=20)
    latency = time.monotonic() - start
    assert latency < 2.0, latency
    assert resp.choices[0].finish_reason == "stop"
    thread.join(60)
    assert "big_s" in result and result["big_s"] < TIMEOUT_S + 10, result
    failed = result["big"].choices[0]  # the request had been accepted: its grammar error ends it
    assert failed.finish_reason == "abort" and not failed.message.content
    assert f"did not compile within the limit of {TIMEOUT_S} s" in failed.stop_reason, failed


def _compile_workers(server_proc) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(server_proc.pid).children(recursive=True):
        try:
            if "compile_worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # gone (or a zombie) between the listing and the look
            pass
    return found


def _both_compile_workers(server_proc) -> dict[int, psutil.Process]:
    """Both compiler processes, waiting for the one the earlier test's time limit replaced
    (its replacement is forked by the pool's thread a moment after the answer goes out)."""
    deadline = time.monotonic() + 30
    while len(workers := {p.pid: p for p in _compile_workers(server_proc)}) != 2:
        assert time.monotonic() < deadline, f"{len(workers)} compiler processes, not 2"
        time.sleep(0.05)
    return workers


def test_a_disconnected_clients_compile_is_killed(client, served):
    server, server_proc = served
    _warm_up(client)
    before = _both_compile_workers(server_proc)
    start = time.monotonic()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/chat/completions", timeout=1.0, headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "messages": MSGS, "max_tokens": 8, "structured_outputs": _so(big("gone"))})
    deadline = start + TIMEOUT_S - 1  # killed for the disconnect (after 1 s), well before the time limit
    while all(p.is_running() for p in before.values()):
        assert time.monotonic() < deadline, "the compile of a disconnected request ran on"
        time.sleep(0.05)
