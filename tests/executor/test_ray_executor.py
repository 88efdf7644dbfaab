"""The "ray" backend on a real two-node Ray cluster (`ray.cluster_utils.Cluster`: two raylets on
this machine, one CPU each): ranks are actors in a placement group, same tokens as in process,
a killed actor is an error, not a hang, and shutdown leaves no actor behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from pagedllm import LLM, SamplingParams
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


def test_one_rank_as_an_actor(cluster, tiny_llama):
    expected = _tokens(_llm(tiny_llama))
    llm = _llm(tiny_llama, distributed_executor_backend="ray")
    executor = llm.llm_engine.engine_core.model_executor
    try:  # a failure here must not leave the placement group holding the cluster's CPUs
        assert type(executor).__name__ == "RayDistributedExecutor" and len(executor.workers) == 1
        assert _tokens(llm) == expected
        (actor,) = executor.workers
        # An actor runs one call at a time: a health check queued behind a 3 s call cannot answer in 0.5 s.
        busy = actor.__ray_call__.remote(lambda _self: time.sleep(3))
        with pytest.raises(TimeoutError, match="did not answer within"):
            executor.collective_rpc("check_health", timeout=0.5)
        ray.get(busy)
        ray.kill(actor)
        with pytest.raises(WorkerDiedError, match="died during"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        executor.shutdown()
    assert executor.workers == [] and executor.placement_group is None
    for _ in range(50):  # the bundles come back
        if ray.available_resources().get("CPU") == 2:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 2


# Each architecture's TP and PP are checked against one rank in tests/distributed (mp backend);
# here one of each layout crosses the two Ray nodes, qwen3 with one KV head split over both.
@pytest.mark.parametrize("layout, arch", [("tensor_parallel_size", "qwen3"), ("pipeline_parallel_size", "llama")])
def test_two_ranks_on_the_two_nodes(cluster, tmp_path, arch, layout):
    """TP=2 puts one rank on each node; PP=2 one stage on each (the stage boundary is the only
    traffic between the machines)."""
    path = make_tiny_model(str(tmp_path), arch, **({"num_key_value_heads": 1} if arch == "qwen3" else {}))
    expected = _tokens(_llm(path))
    llm = _llm(path, distributed_executor_backend="ray", **{layout: 2})
    executor = llm.llm_engine.engine_core.model_executor
    assert len(set(executor.node_ids)) == 2
    assert llm.llm_engine.engine_core.batch_queue_size == (2 if layout == "pipeline_parallel_size" else 1)
    assert _tokens(llm) == expected
    executor.shutdown()


def test_an_existing_cluster_is_found_through_ray_address(cluster, tiny_llama):
    """A driver that never calls ray.init joins the cluster named by RAY_ADDRESS (as after
    `ray start --head` and `ray start --address=...` on the machines)."""
    script = (
        "import json, sys\n"
        "from pagedllm import LLM, SamplingParams\n"
        "llm = LLM(sys.argv[1], dtype='float32', kv_cache_memory=1 << 24, distributed_executor_backend='ray',"
        " tensor_parallel_size=2)\n"
        "ex = llm.llm_engine.engine_core.model_executor\n"
        "outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),"
        " use_tqdm=False)\n"
        "print(json.dumps([len(set(ex.node_ids)), [o.outputs[0].token_ids for o in outs]]))\n"
        "ex.shutdown()\n"
    )
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    done = subprocess.run([sys.executable, "-c", script, tiny_llama, json.dumps(PROMPTS)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    num_nodes, tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert num_nodes == 2 and tokens == _tokens(_llm(tiny_llama))
