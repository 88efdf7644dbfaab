"""`pagedllm bench compare` without servers: its flags, its table, the missing-matplotlib message,
and llama.cpp's /tokenize. The run against real servers is in test_cli_clients.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from pagedllm.entrypoints.cli.bench_compare import MATPLOTLIB_MISSING, _endpoint, format_table, run_bench_compare
from pagedllm.entrypoints.cli.bench_serve import _one, _prompts, _tokenize
from pagedllm.entrypoints.cli.main import build_parser, main


def _metrics(throughput: float) -> dict:
    m = {"completed": 4, "num_prompts": 4, "failed": 0, "request_throughput": throughput / 10,
         "output_throughput": throughput}
    for name in ("ttft", "itl", "tpot"):
        m.update({f"median_{name}_ms": 1.5, f"p90_{name}_ms": 2.25, f"p99_{name}_ms": 3.0})
    return m


def test_endpoints_parse():
    assert _endpoint("vllm=http://h:8001/v1/") == ("vllm", "http://h:8001")
    assert _endpoint(" llama = https://h:8080 ") == ("llama", "https://h:8080")
    for bad in ("http://h:8001", "x=h:8001", "=http://h"):
        with pytest.raises(argparse.ArgumentTypeError):
            _endpoint(bad)
    args = build_parser().parse_args(["bench", "compare", "--url", "a=http://x/v1", "--url", "b=http://y"])
    assert args.url == [("a", "http://x"), ("b", "http://y")] and args.num_prompts == 64


def test_table_has_a_row_per_system_and_failures_last():
    llama = {**_metrics(80.5), "completed": 3, "failed": 1, "first_error": "no completion tokens: 0 text chunks"}
    table = format_table({"pagedllm": _metrics(120.0), "vllm": {"error": "ConnectError: refused", "failed": 4},
                          "llama": llama})
    header, rule, *rows = table.splitlines()
    assert header.split()[:4] == ["System", "OK", "Req/s", "Out"] and set(rule) == {"-"}
    assert rows[0].split() == ["pagedllm", "4/4", "12.00", "120.0", "1.5", "2.2", "3.0", "1.5", "3.0", "1.5", "3.0"]
    assert rows[1].split()[:4] == ["llama", "3/4", "8.05", "80.5"]
    assert rows[2].startswith("vllm") and "failed: ConnectError: refused" in rows[2]
    assert rows[3].split() == ["llama", "1", "failed,", "the", "first:", "no", "completion", "tokens:", "0", "text",
                               "chunks"]


def test_bad_invocations(capsys, monkeypatch):
    assert main(["bench", "compare"]) == 2
    assert "nothing to compare" in capsys.readouterr().err
    assert main(["bench", "compare", "--url", "a=http://x", "--url", "a=http://y"]) == 2
    assert "own name" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: said before any benchmark runs
    args = build_parser().parse_args(["bench", "compare", "--url", "a=http://127.0.0.1:9", "--plot", "x.png"])
    with pytest.raises(ValueError, match="pip install 'pagedllm\\[bench\\]'") as e:
        run_bench_compare(args)
    assert str(e.value) == MATPLOTLIB_MISSING


def test_shared_prefix_workload():
    """--random-prefix-len: every prompt starts with the same tokens, then has its own."""
    def server(request: httpx.Request) -> httpx.Response:
        words = json.loads(request.content)["prompt"].split()
        return httpx.Response(200, json={"tokens": [hash(w) % 1000 for w in words]})

    async def run(prefix_len: int) -> list[list[int]]:
        args = build_parser().parse_args(["bench", "serve", "--num-prompts", "8", "--input-len", "12",
                                          "--random-prefix-len", str(prefix_len)])
        async with httpx.AsyncClient(transport=httpx.MockTransport(server), base_url="http://s") as client:
            return await _prompts(client, args, "m")

    prompts = asyncio.run(run(100))
    assert [len(p) for p in prompts] == [112] * 8
    assert len({tuple(p[:100]) for p in prompts}) == 1 and len({tuple(p[100:]) for p in prompts}) > 1
    assert [p[100:] for p in prompts] == asyncio.run(run(0))  # the same own parts, after the prefix
    assert main(["bench", "serve", "--random-prefix-len", "-1"]) == 2


def test_unreachable_server_is_a_failed_row(capsys):
    args = build_parser().parse_args(["bench", "compare", "--url", "down=http://127.0.0.1:9", "--num-prompts", "2"])
    assert run_bench_compare(args) == 1
    assert "failed: ConnectError" in capsys.readouterr().out


def test_tokenize_falls_back_to_llama_cpp():
    def llama_server(request: httpx.Request) -> httpx.Response:
        if b'"content"' not in request.content:
            return httpx.Response(500, json={"error": "content is required"})
        return httpx.Response(200, json={"tokens": [5, 6, 7]})

    async def run(handler) -> list[int]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://llama") as client:
            return await _tokenize(client, "m", "some text")

    assert asyncio.run(run(llama_server)) == [5, 6, 7]
    with pytest.raises(ValueError, match="no /tokenize"):
        asyncio.run(run(lambda request: httpx.Response(404, json={})))


def test_a_stream_without_tokens_is_a_failure_that_says_what_came_back():
    """A stream that ends without a usage chunk (or with 0 completion tokens) fails, and its
    error says what the server did send."""
    def server(body: str):
        return lambda request: httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def run(body: str):
        args = build_parser().parse_args(["bench", "serve", "--output-len", "4"])
        async with httpx.AsyncClient(transport=httpx.MockTransport(server(body)), base_url="http://s") as client:
            return await _one(client, "m", [1, 2, 3], args)

    chunk = 'data: {"choices": [{"text": "hi", "finish_reason": null}]}\n\n'
    done = 'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
    usage = 'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\n'
    result = asyncio.run(run(chunk * 2 + done))
    assert not result.ok and result.error == "no completion tokens: 2 text chunks, finish_reason 'length', usage None"
    result = asyncio.run(run(chunk * 2 + usage + "data: [DONE]\n\n"))
    assert result.ok and result.output_tokens == 2 and not result.error and len(result.itl) == 1
    error = 'data: {"error": {"message": "slot unavailable", "code": 503}}\n\n'
    result = asyncio.run(run(error + usage.replace("2", "0")))
    assert not result.ok and result.error == ("no completion tokens: 0 text chunks, finish_reason None, usage "
                                              "{'completion_tokens': 0}, error {'message': 'slot unavailable', "
                                              "'code': 503}")


def test_peak_rss_of_a_launched_process_tree():
    """`LaunchedServer.peak_rss_bytes` sums VmHWM over the process and its children: a child that
    touched 64 MiB shows in it."""
    import psutil

    from pagedllm.entrypoints.cli.bench_compare import LaunchedServer

    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'b = bytearray(64 << 20); print(1, flush=True); import time; time.sleep(30)']); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            kids = psutil.Process(proc.pid).children()
            if kids and psutil.Process(kids[0].pid).memory_info().rss > 64 << 20:
                break
            time.sleep(0.05)
        assert LaunchedServer("http://x", 0.0, proc).peak_rss_bytes() > 64 << 20
        assert LaunchedServer("http://x", 0.0).peak_rss_bytes() == 0
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()
