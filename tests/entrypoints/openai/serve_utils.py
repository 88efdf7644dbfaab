"""`pagedllm serve` on the tiny model as a real process, for the end-to-end tests: start it,
read its metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from pagedllm.entrypoints.cli.bench_compare import stop_process
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE
from tests.utils import free_port, wait_healthy

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny"


def serve_tiny(model: str, tmp_path_factory, procs: list | None = None, extra_args: tuple[str, ...] = (),
               env: dict[str, str] | None = None, logs: list | None = None, chat_template: str | None = CHAT_TEMPLATE):
    """Start `pagedllm serve` on `model` (a tiny test model), yield its URL once healthy, stop it afterwards. `env`:
    variables for the server process on top of this one's; `logs` gets the path of its output; `chat_template`
    None: the model's own (or pagedllm's shipped) template."""
    template_args: tuple[str, ...] = ()
    if chat_template is not None:
        template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
        template.write_text(chat_template)
        template_args = ("--chat-template", str(template))
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "16MiB", "--served-model-name", MODEL,
           *template_args, "--api-key", API_KEY, "--max-model-len", "256",
           "--uvicorn-log-level", "warning", *extra_args]
    log = tmp_path_factory.mktemp("log") / "server.log"
    if logs is not None:
        logs.append(log)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PAGEDLLM_API_KEY": "", **(env or {})})
    if procs is not None:
        procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        yield url
    finally:
        stop_process(proc, timeout=20)


def read_metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics", headers=AUTH).text.splitlines():
        if line.startswith("pagedllm:"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0] if "finished_reason" not in name else name] = float(value)
    return values


def metrics_once_idle(url: str, wait_s: float = 5.0) -> dict[str, float]:
    """The metrics once no request runs and no KV block is in use (asserted within ~`wait_s`)."""
    for _ in range(int(wait_s / 0.05)):
        metrics = read_metrics(url)
        if metrics["pagedllm:num_requests_running"] == 0 and metrics["pagedllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.05)
    assert metrics["pagedllm:num_requests_running"] == 0 and metrics["pagedllm:kv_cache_usage_perc"] == 0
    return metrics
