"""The "ray" backend on a real two-node Ray cluster (`ray.cluster_utils.Cluster`: two raylets on
this machine, one CPU each): ranks are actors in a placement group, same tokens as in process,
a killed actor is an error, not a hang, and shutdown leaves no actor behind."""

from __future__ import annotations

import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor.abstract import WorkerDiedError

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

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
    assert type(executor).__name__ == "RayDistributedExecutor" and len(executor.workers) == 1
    assert _tokens(llm) == expected
    with pytest.raises(TimeoutError, match="did not answer within"):
        executor.collective_rpc("check_health", timeout=1e-6)
    (actor,) = executor.workers
    ray.kill(actor)
    with pytest.raises(WorkerDiedError, match="died during"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    executor.shutdown()
    assert executor.workers == [] and executor.placement_group is None
    for _ in range(50):  # the bundles come back
        if ray.available_resources().get("CPU") == 2:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 2


def test_tensor_parallel_across_the_two_nodes(cluster, tiny_llama):
    expected = _tokens(_llm(tiny_llama))
    llm = _llm(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray")
    executor = llm.llm_engine.engine_core.model_executor
    assert len(set(executor.node_ids)) == 2  # one CPU per node: one rank on each
    assert _tokens(llm) == expected
    executor.shutdown()


def test_pipeline_stages_on_different_nodes(cluster, tiny_gemma3):
    expected = _tokens(_llm(tiny_gemma3))
    llm = _llm(tiny_gemma3, pipeline_parallel_size=2, distributed_executor_backend="ray")
    executor = llm.llm_engine.engine_core.model_executor
    assert executor.node_ids[0] != executor.node_ids[1]  # stage 0 on one node, stage 1 on the other
    assert llm.llm_engine.engine_core.batch_queue_size == 2
    assert _tokens(llm) == expected
    executor.shutdown()
