"""Shutdown leaves nothing behind: `pagedllm serve` stopped by SIGINT or SIGTERM, a start that
fails in the engine core, and an engine dropped without shutdown() leave no child process, no
IPC directory (`pagedllm-*` in the temp dir) and no listening port. The server's start-up log names
each phase."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import httpx
import psutil
import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from tests.utils import free_port, wait_healthy

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _ipc_dirs(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("pagedllm-"))


def _listening(port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in psutil.net_connections("tcp"))


def _start_server(model: str, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, int, Path, Path]:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-X", "faulthandler", "-m", "pagedllm.entrypoints.cli.main", "serve", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "16MiB",
           "--max-model-len", "256", "--served-model-name", "tiny", "--uvicorn-log-level", "warning", *extra]
    env = {**os.environ, "TMPDIR": str(tmpdir), "PAGEDLLM_LOGGING_LEVEL": "INFO", "PAGEDLLM_API_KEY": ""}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_sigint_as_in_a_terminal)
    return proc, port, tmpdir, log


def _sigint_as_in_a_terminal() -> None:
    """SIGINT back to its default in the server: a suite run as a background job (`... &` in a
    script) inherits an ignored SIGINT, which `pagedllm serve` keeps ignored, as a background
    job's should be; the tests stand for a server started from a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_serve_stops_cleanly(tiny_llama, tmp_path):
    """SIGTERM after serving. SIGINT reaches the same handler (serve.py turns both into one
    KeyboardInterrupt); `test_sigint_during_start_up_stops_at_once` shows that handler installed."""
    proc, port, tmpdir, log = _start_server(tiny_llama, tmp_path)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children and _ipc_dirs(tmpdir) and _listening(port)  # the engine core, its IPC dir, the port
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(60)
    finally:
        _stop(proc)
    text = log.read_text()
    assert returncode == 0, text
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running: {alive}\n{text}"
    assert not _ipc_dirs(tmpdir), text
    assert not _listening(port)
    assert "Traceback" not in text, text
    # One line per start-up phase, the engine core's lines in the same format with its pid.
    for phrase in ("Tokenizer and config: LlamaForCausalLM", "(EngineCore pid=", "Weights: LlamaForCausalLM",
                   "KV cache: ", "maximum concurrency at max_model_len 256", "Warm-up: ", "Engine core ready in",
                   f"Serving tiny on http://127.0.0.1:{port}"):
        assert phrase in text, f"{phrase!r} not in the log:\n{text}"
    assert "INFO " in text and "[core.py:" in text


def test_failed_start_leaves_nothing_behind(tiny_llama, tmp_path):
    """A KV cache smaller than max_model_len fails in the engine core, after the IPC directory exists."""
    proc, port, tmpdir, log = _start_server(tiny_llama, tmp_path, "--kv-cache-memory", "1KiB")
    try:
        returncode = proc.wait(120)
    finally:
        _stop(proc)
    text = log.read_text()
    assert returncode != 0 and "KV cache holds" in text, text
    assert not _ipc_dirs(tmpdir), text
    assert not _listening(port)


@pytest.mark.parametrize("extra, message", [(["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
                                             (["--no-such-flag"], "unrecognized arguments: --no-such-flag")],
                         ids=["bad-value", "bad-flag"])
def test_bad_arguments_stop_the_prestarted_core(tiny_llama, tmp_path, extra, message):
    """`pagedllm serve` starts its engine-core process before it parses its flags; a bad flag or
    value stops that process too."""
    proc, port, tmpdir, log = _start_server(tiny_llama, tmp_path, *extra)
    try:
        returncode = proc.wait(120)
    finally:
        _stop(proc)
    text = log.read_text()
    assert returncode == 2 and message in text and "Traceback" not in text, text
    assert not _ipc_dirs(tmpdir), text
    left = [p for p in psutil.process_iter(["cmdline"]) if str(tmpdir) in " ".join(p.info["cmdline"] or [])]
    assert not left, left


def test_sigint_during_start_up_stops_at_once(tiny_llama, tmp_path):
    """Ctrl-C while the engine core loads: the start is abandoned, not finished first. (The C
    kernels are built beforehand: this is about the engine's start, not a first compile.)"""
    from pagedllm.model_executor.layers import cpu_kernels

    cpu_kernels.kernels()
    proc, port, tmpdir, log = _start_server(tiny_llama, tmp_path)
    try:
        deadline = time.time() + 120
        while "Tokenizer and config" not in log.read_text():  # the front now waits for the core
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.05)
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        try:
            returncode = proc.wait(30)
        except subprocess.TimeoutExpired:  # where the front is stuck: faulthandler's dump, in the warnings summary
            proc.send_signal(signal.SIGABRT)
            proc.wait(10)
            warnings.warn(f"the front outlived SIGINT by 30 s; its threads:\n{log.read_text()[-8000:]}", stacklevel=1)
            raise
    finally:
        _stop(proc)
    text = log.read_text()
    assert returncode == 0 and "Serving tiny" not in text, text
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive and not _ipc_dirs(tmpdir) and not _listening(port), text


@pytest.fixture
def fresh_tmpdir(tmp_path, monkeypatch) -> Path:
    """tempfile's directory for this process, fresh (tempfile caches it, so TMPDIR alone is not enough)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_async_llm_dropped_without_shutdown_cleans_up(tiny_llama, fresh_tmpdir):
    before = _children()
    eng = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory=1 << 22))

    async def run(engine):
        return [out async for out in engine.generate([5, 6, 7], GREEDY, "r")]

    assert asyncio.run(run(eng))[-1].finished
    core = psutil.Process(eng.client.proc.pid)
    assert _ipc_dirs(fresh_tmpdir)
    del eng
    gc.collect()
    _, alive = psutil.wait_procs([core], timeout=10)
    assert not alive and _children() <= before
    # The last reference may drop on the output reader thread, which then finishes the cleanup.
    deadline = time.monotonic() + 10
    while _ipc_dirs(fresh_tmpdir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _ipc_dirs(fresh_tmpdir)


def test_llm_dropped_leaves_nothing(tiny_llama, fresh_tmpdir):
    """The offline LLM runs its engine core in process: it starts nothing that could outlive it."""
    before = _children()
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 22)
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].finished
    assert _children() <= before
    del llm
    gc.collect()
    assert _children() <= before and not _ipc_dirs(fresh_tmpdir)


def test_an_interrupt_a_library_wrapped_still_stops_cleanly(monkeypatch):
    """A Ctrl-C that lands while pydantic builds a route's schema comes out as pydantic's own
    error, the KeyboardInterrupt inside it: `serve` still exits 0. Without a signal, an error is
    an error."""
    from pagedllm.entrypoints.cli import serve
    from pagedllm.entrypoints.cli.main import build_parser

    async def interrupted(args):
        try:
            serve._raise_interrupt(signal.SIGINT, None)
        except KeyboardInterrupt as e:
            raise RuntimeError("Error building 'literal' validator") from e

    async def broken(args):
        raise RuntimeError("not an interrupt")

    monkeypatch.setattr(serve.signal, "signal", lambda *a: None)
    monkeypatch.setattr(serve, "_stop_signals", [])
    monkeypatch.setattr(serve, "_serve", broken)
    with pytest.raises(RuntimeError, match="not an interrupt"):
        serve.run_serve(build_parser().parse_args(["serve", "/m"]))
    monkeypatch.setattr(serve, "_serve", interrupted)
    assert serve.run_serve(build_parser().parse_args(["serve", "/m"])) == 0
