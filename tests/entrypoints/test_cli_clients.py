"""The CLI against a real `pagedllm serve` of the tiny model, started with `--config`: the file's
flags apply and the command line's override them; `pagedllm chat` in a pty keeps the conversation
across turns, `pagedllm complete` streams what a plain request returns; `pagedllm bench compare`
measures this server under two names beside one it starts itself, and plots them."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import httpx
import pytest

from pagedllm.entrypoints.cli.main import main
from tests.entrypoints.openai.serve_utils import API_KEY, AUTH, MODEL, serve_tiny

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli.main"]
ENV = {**os.environ, "PYTHONIOENCODING": "utf-8", "OPENAI_API_KEY": "", "PAGEDLLM_API_KEY": ""}
# --max-model-len and --served-model-name are on the command line too (serve_tiny): theirs win.
CONFIG = """\
max-model-len: 128
served-model-name: [from-the-file]
enable-tokenizer-info-endpoint: true
max-n: 2
enable-prefix-caching: false
"""


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    cfg.write_text(CONFIG)
    yield from serve_tiny(tiny_llama, tmp_path_factory, extra_args=("--config", str(cfg)))


def test_serve_config_file(server):
    (card,) = httpx.get(f"{server}/v1/models", headers=AUTH).json()["data"]
    assert card["id"] == MODEL and card["max_model_len"] == 256  # the command line over the file
    assert httpx.get(f"{server}/tokenizer_info", headers=AUTH).status_code == 200  # from the file
    r = httpx.post(f"{server}/v1/completions", headers=AUTH,
                   json={"model": MODEL, "prompt": "Hi", "n": 3, "max_tokens": 1, "temperature": 1.0})
    assert r.status_code == 400 and "max_n" in r.json()["error"]["message"]


def _reference(server: str, path: str, body: dict) -> str:
    r = httpx.post(f"{server}/v1{path}", headers=AUTH, json={"model": MODEL, "temperature": 0, "max_tokens": 8, **body})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


class Pty:
    """A command on a pseudo-terminal, as a person would run it."""

    def __init__(self, cmd: list[str]) -> None:
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=ENV, close_fds=True)
        os.close(slave)
        self.out = b""

    def wait_for(self, marker: bytes, count: int, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while self.out.count(marker) < count:
            assert time.monotonic() < deadline, f"no {marker!r} x{count} in {self.out!r}"
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.out += os.read(self.master, 4096)
                except OSError:  # the other side closed
                    break
        return self.out.decode("utf-8", "replace")

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def close(self) -> int:
        rc = self.proc.wait(timeout=30)
        os.close(self.master)
        return rc


def test_chat_in_a_terminal_keeps_the_conversation(server):
    system = {"role": "system", "content": "Be brief."}
    tty = Pty([*CLI, "chat", "--url", f"{server}/v1", "--api-key", API_KEY, "--system-prompt", "Be brief.",
               "--temperature", "0", "--max-tokens", "8"])
    try:
        tty.wait_for(b"\n> ", 1)  # the banner, then the prompt
        tty.send(b"Hello, my name is\n")
        tty.wait_for(b"\n> ", 2)
        tty.send(b"Tell me more\n")
        tty.wait_for(b"\n> ", 3)
        tty.send(b"\x04")  # Ctrl-D
        assert tty.close() == 0
    finally:
        tty.proc.kill()
    text = tty.out.decode("utf-8", "replace").replace("\r", "")
    assert f"Chatting with {MODEL}" in text
    turns = text.split("\n> ")[1:3]
    echoed, replies = zip(*(t.split("\n", 1) for t in turns))
    assert echoed == ("Hello, my name is", "Tell me more")
    first = [system, {"role": "user", "content": "Hello, my name is"}]
    reply1 = _reference(server, "/chat/completions", {"messages": first})
    assert replies[0] == reply1
    second = [*first, {"role": "assistant", "content": reply1}, {"role": "user", "content": "Tell me more"}]
    reply2 = _reference(server, "/chat/completions", {"messages": second})
    assert replies[1] == reply2
    # the second turn depended on the first: without it the reply differs
    assert reply2 != _reference(server, "/chat/completions", {"messages": [system, second[-1]]})


def test_complete_quick_and_piped(server):
    url = ["--url", f"{server}/v1", "--temperature", "0", "--max-tokens", "8"]
    quick = subprocess.run([*CLI, "complete", *url, "--api-key", API_KEY, "-q", "The quick brown fox"],
                           capture_output=True, text=True, env=ENV, timeout=60)
    assert quick.returncode == 0, quick.stderr
    assert quick.stdout == _reference(server, "/completions", {"prompt": "The quick brown fox"}) + "\n"
    # the key from the environment; lines from a pipe; "exit" quits
    piped = subprocess.run([*CLI, "complete", *url], input="Hello\nexit\nnever sent\n", capture_output=True,
                           text=True, env={**ENV, "PAGEDLLM_API_KEY": API_KEY}, timeout=60)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == "> " + _reference(server, "/completions", {"prompt": "Hello"}) + "\n> "


def test_chat_quick_errors(server, capsys, monkeypatch):
    for env in ("OPENAI_API_KEY", "PAGEDLLM_API_KEY"):
        monkeypatch.delenv(env, raising=False)
    url = ["--url", f"{server}/v1", "-q", "Hi"]
    assert main(["chat", *url, "--api-key", "wrong"]) == 2
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["chat", *url, "--api-key", API_KEY, "--model-name", "nope"]) == 2
    assert "HTTP 404" in capsys.readouterr().err
    assert main(["chat", "--url", "http://127.0.0.1:9/v1", "-q", "Hi"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_bench_compare_two_servers(server, tiny_llama, tmp_path):
    png, out_json = tmp_path / "compare.png", tmp_path / "compare.json"
    r = subprocess.run(
        [*CLI, "bench", "compare", "--url", f"a={server}/v1", "--url", f"b={server}", "--api-key", API_KEY,
         "--model", tiny_llama, "--server-args=--dtype float32 --kv-cache-memory 16MiB --max-model-len 256",
         "--num-prompts", "6", "--input-len", "8", "--output-len", "5", "--max-concurrency", "2",
         "--warmup-prompts", "1", "--plot", str(png), "--output-json", str(out_json)],
        capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    header, rule, *rows = r.stdout.strip().splitlines()
    assert header.split()[:4] == ["System", "OK", "Req/s", "Out"] and "TTFT p90 ms" in header
    assert [row.split()[:2] for row in rows] == [["pagedllm", "6/6"], ["a", "6/6"], ["b", "6/6"]]
    metrics = json.loads(out_json.read_text())
    assert list(metrics) == ["pagedllm", "a", "b"]
    for m in metrics.values():
        assert m["completed"] == 6 and m["total_output_tokens"] == 30 and m["output_throughput"] > 0
        assert 0 < m["median_ttft_ms"] <= m["p90_ttft_ms"] <= m["p99_ttft_ms"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
