"""The "ray" backend on a real two-node Ray cluster (`ray.cluster_utils.Cluster`: two raylets on
this machine, one CPU each): ranks are actors in a placement group, same tokens as in process,
a killed actor is an error, not a hang, and shutdown leaves no actor, and no actor's process, behind."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import time
import types
import weakref

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from pagedllm import LLM, SamplingParams
from pagedllm.executor import ray_distributed_executor
from pagedllm.executor.abstract import WorkerDiedError
from tests.utils import make_tiny_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _llm(model: str, **kw) -> LLM:
    return LLM(model, dtype="float32", kv_cache_memory=1 << 24, **kw)


def _gone(pids: list[int], timeout: float) -> bool:
    """Whether every process of `pids` is gone (or a zombie) within `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                alive += [pid] if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE else []
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.05)


def _wait_for_cpus(n: int) -> None:
    """The placement group's bundles come back to the cluster."""
    for _ in range(50):
        if ray.available_resources().get("CPU") == n:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == n


def test_one_rank_as_an_actor(cluster, tiny_llama):
    """Also: shutdown after the actor was killed from outside, and a second shutdown, return at
    once and leave no process."""
    expected = _tokens(_llm(tiny_llama))
    llm = _llm(tiny_llama, distributed_executor_backend="ray")
    executor = llm.llm_engine.engine_core.model_executor
    pids = executor.worker_pids
    try:  # a failure here must not leave the placement group holding the cluster's CPUs
        assert type(executor).__name__ == "RayDistributedExecutor" and len(executor.workers) == 1
        assert _tokens(llm) == expected
        (actor,) = executor.workers
        # An actor runs one call at a time: a health check queued behind a 1.5 s call cannot answer in 0.5 s.
        busy = actor.__ray_call__.remote(lambda _self: time.sleep(1.5))
        with pytest.raises(TimeoutError, match="did not answer within"):
            executor.collective_rpc("check_health", timeout=0.5)
        ray.get(busy)
        ray.kill(actor)
        with pytest.raises(WorkerDiedError, match="died during"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        start = time.monotonic()
        executor.shutdown()
        first = time.monotonic() - start
    assert first < 8 and _gone(pids, 0)  # within the executor's wait, and the process is gone
    start = time.monotonic()
    executor.shutdown()
    assert time.monotonic() - start < 0.5
    assert executor.workers == [] and executor.placement_group is None
    _wait_for_cpus(2)


# Each architecture's TP and PP are checked against one rank in tests/distributed (mp backend);
# here one of each layout crosses the two Ray nodes: PP with llama below, TP with qwen3 (one KV
# head split over both) from a driver that finds the cluster through RAY_ADDRESS.
def test_two_pipeline_stages_on_the_two_nodes(cluster, tiny_llama):
    """PP=2 puts one stage on each node (the stage boundary is the only traffic between the machines)."""
    expected = _tokens(_llm(tiny_llama))
    llm = _llm(tiny_llama, distributed_executor_backend="ray", pipeline_parallel_size=2)
    executor = llm.llm_engine.engine_core.model_executor
    assert len(set(executor.node_ids)) == 2
    assert llm.llm_engine.engine_core.batch_queue_size == 2
    assert _tokens(llm) == expected
    executor.shutdown()


def test_an_existing_cluster_is_found_through_ray_address(cluster, tmp_path):
    """A driver that never calls ray.init joins the cluster named by RAY_ADDRESS (as after
    `ray start --head` and `ray start --address=...` on the machines); TP=2 puts one rank on each node."""
    path = make_tiny_model(str(tmp_path), "qwen3", num_key_value_heads=1)
    script = (
        "import json, sys\n"
        "from pagedllm import LLM, SamplingParams\n"
        "llm = LLM(sys.argv[1], dtype='float32', kv_cache_memory=1 << 24, distributed_executor_backend='ray',"
        " tensor_parallel_size=2)\n"
        "ex = llm.llm_engine.engine_core.model_executor\n"
        "outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),"
        " use_tqdm=False)\n"
        "print(json.dumps([len(set(ex.node_ids)), llm.llm_engine.engine_core.batch_queue_size,"
        " [o.outputs[0].token_ids for o in outs]]))\n"
        "ex.shutdown()\n"
    )
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    done = subprocess.run([sys.executable, "-c", script, path, json.dumps(PROMPTS)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    num_nodes, batch_queue_size, tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert num_nodes == 2 and batch_queue_size == 1 and tokens == _tokens(_llm(path))


def test_del_under_load_leaves_no_worker_process(cluster, tiny_llama):
    """`del llm` on a busy machine: the executor's finalizer kills both ranks' actors and waits
    until their processes are gone."""
    llm = _llm(tiny_llama, distributed_executor_backend="ray", tensor_parallel_size=2)
    executor = llm.llm_engine.engine_core.model_executor
    pids = executor.worker_pids
    assert len(pids) == 2 and all("RayWorkerWrapper" in " ".join(psutil.Process(p).cmdline()) for p in pids)
    collected = weakref.ref(executor)
    del executor
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        start = time.monotonic()
        del llm
        gc.collect()
        assert collected() is None
        assert _gone(pids, 10 - (time.monotonic() - start)), f"Ray workers {pids} still alive after 10 s"
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    _wait_for_cpus(2)


def test_shutdown_after_ray_is_gone_kills_leftover_processes(monkeypatch):
    """Ray already shut down (the handles are void): shutdown still waits for the processes,
    SIGKILLs those that outlive the wait, names them in a warning, and runs once."""
    monkeypatch.setattr(ray_distributed_executor, "_SHUTDOWN_WAIT_S", 0.3)
    stubborn = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    fake_ray = types.SimpleNamespace(is_initialized=lambda: False, shutdown=lambda: pytest.fail("not started here"))
    workers = ray_distributed_executor._RayWorkers(fake_ray, lambda pg: pytest.fail("Ray is gone"), started_ray=True,
                                                   actors=[object()], procs=[psutil.Process(stubborn.pid), None])
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    ray_distributed_executor.logger.addHandler(handler)
    try:
        start = time.monotonic()
        workers.close()
        workers.close()
        assert time.monotonic() - start < 3
        assert stubborn.wait(timeout=5) == -9
    finally:
        ray_distributed_executor.logger.removeHandler(handler)
        stubborn.kill()
        stubborn.wait()
    assert [str(stubborn.pid) in r.getMessage() and r.levelno == logging.WARNING for r in records] == [True]
