"""Faults with more than one rank: a rank killed with SIGKILL fails the engine within seconds
(the server answers 503, the stream ends, nothing hangs), a stopped rank is a TimeoutError of
`collective_rpc`, and shutdown leaves no worker process and no IPC directory behind."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import time

import httpx
import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor.abstract import WorkerDiedError
from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny
from tests.utils import worker_ranks

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _worker_dirs(root: str | None = None) -> set[str]:
    return set(glob.glob(os.path.join(root or tempfile.gettempdir(), "pagedllm-workers-*")))


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    running = []
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc)
        except psutil.NoSuchProcess:
            pass
    return running


def test_a_killed_rank_fails_the_server_and_shutdown_leaves_nothing(tiny_llama, tmp_path_factory):
    procs: list = []
    # The server's own temp dir: another test file running beside this one may hold worker dirs of its own.
    tmp = str(tmp_path_factory.mktemp("server_tmp"))
    serving = serve_tiny(tiny_llama, tmp_path_factory, procs, extra_args=("--tensor-parallel-size", "2"),
                         env={"TMPDIR": tmp})
    url = next(serving)
    try:
        descendants = psutil.Process(procs[0].pid).children(recursive=True)
        ranks = worker_ranks(procs[0].pid)
        assert len(ranks) == 2
        assert _worker_dirs(tmp)  # the running server's, removed at shutdown (checked below)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            ranks[1].send_signal(signal.SIGKILL)
            start = time.monotonic()
            rest = list(lines)  # the stream ends instead of hanging
            assert time.monotonic() - start < 15
        assert any("error" in line for line in rest)
        deadline = time.monotonic() + 15
        while httpx.get(f"{url}/health").status_code != 503:
            assert time.monotonic() < deadline, "/health still answers 200 after a rank died"
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                       headers=AUTH, timeout=10)
        assert r.status_code == 503
    finally:
        next(serving, None)  # SIGTERM, wait
    # The workers' forkserver leaves once the engine core and the last rank are gone.
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert not _running(alive)
    assert not _worker_dirs(tmp)


def test_stopped_rank_times_out_and_killed_stage_fails_the_step(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 22, pipeline_parallel_size=2)
    executor = llm.llm_engine.engine_core.model_executor
    pids = executor.worker_pids
    os.kill(pids[1], signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError, match=r"worker ranks \[1\] did not answer within 0.5 s"):
            executor.collective_rpc("check_health", timeout=0.5)
    finally:
        os.kill(pids[1], signal.SIGCONT)
    assert executor.collective_rpc("check_health", timeout=10) == [None, None]
    os.kill(pids[0], signal.SIGKILL)  # the first stage: the last one waits for hidden states that never come
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 0"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 5
    executor.shutdown()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
