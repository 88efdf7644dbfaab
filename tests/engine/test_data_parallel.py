"""Data parallel (-dp N): N engine cores, each with its own executor and KV cache, behind one
front end. Same tokens as one core, requests spread by load, aborts reach the right core, stats
per core and in total, and a dead core fails the engine instead of hanging it."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.engine import core_launch
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_launch import prestart_core
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.abstract import StepFuture
from tests.utils import make_tiny_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(llm: LLM, params=GREEDY) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("arch, backend", [("llama", "uni"), ("qwen3", "uni"), ("gemma3", "uni"), ("gemma3", "mp")])
def test_offline_same_tokens_as_one_core_and_both_cores_work(arch, backend, tmp_path):
    path = make_tiny_model(str(tmp_path), arch)
    kw = dict(dtype="float32", kv_cache_memory=1 << 24)
    sampled = SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=6, ignore_eos=True)
    expected = _tokens(LLM(path, **kw)), _tokens(LLM(path, **kw), sampled)
    llm = LLM(path, data_parallel_size=2, distributed_executor_backend=backend, **kw)
    assert len(llm.llm_engine.engine_cores) == 2
    assert (_tokens(llm), _tokens(llm, sampled)) == expected
    per_core = llm.llm_engine.get_engine_stats()
    assert all(s["prefix_cache_queries"] > 0 for s in per_core)  # both cores ran requests
    total = llm.llm_engine.get_stats()
    assert total["num_total_blocks"] == sum(s["num_total_blocks"] for s in per_core)
    assert llm.llm_engine.balancer.num_unfinished == [0, 0]
    for core in llm.llm_engine.engine_cores:
        core.shutdown()


def test_async_engine_spreads_aborts_and_fails_when_a_core_dies(tiny_llama):
    prestart_core()  # as `pagedllm serve` does: data parallel starts its own cores and stops this one
    prestarted = core_launch._prestarted.proc
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory=1 << 24,
                                                  data_parallel_size=2))
    assert prestarted.poll() is not None and prestarted.pid not in [c.proc.pid for c in engine.clients]
    cores = [psutil.Process(c.proc.pid) for c in engine.clients]
    try:
        async def collect(prompt, request_id, params=GREEDY):
            return [out async for out in engine.generate(prompt, params, request_id)][-1]

        async def scenario():
            results = await asyncio.gather(*[collect(p, f"r{i}") for i, p in enumerate(PROMPTS)])
            # A long request on each core, then one aborted: its core frees it, the other keeps going.
            long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
            gens = [engine.generate([5, 6], long, f"long{i}") for i in range(2)]
            for gen in gens:
                await gen.__anext__()
            per_core = await engine.get_engine_stats()
            await gens[0].aclose()
            for _ in range(100):
                after = await engine.get_engine_stats()
                if sum(s["num_running"] for s in after) == 1:
                    break
                await asyncio.sleep(0.05)
            total = await engine.get_stats()
            await gens[1].aclose()
            return results, per_core, after, total

        results, per_core, after, total = asyncio.run(scenario())
        expected = [o.outputs[0].token_ids for o in LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24)
                    .generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert [r.outputs[0].token_ids for r in results] == expected
        assert [s["num_running"] for s in per_core] == [1, 1]  # one long request per core
        assert sorted(s["num_running"] for s in after) == [0, 1] and total["num_running"] == 1
        assert all(s["prefix_cache_queries"] > 0 for s in after)

        cores[1].kill()
        deadline = time.monotonic() + 5
        while engine.is_running:  # the reader thread notices within a second
            assert time.monotonic() < deadline, "a dead engine core went unnoticed"
            time.sleep(0.05)
        with pytest.raises(EngineDeadError):  # the other core is alive, but the engine has failed
            asyncio.run(asyncio.wait_for(collect([1, 2, 3], "after"), timeout=30))
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.check_health())
    finally:
        engine.shutdown()
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in cores)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_interrupted_core_still_pairs_the_others_and_delivers_their_outputs(tiny_llama, monkeypatch,
                                                                            async_scheduling):
    """Ctrl-C while core 0 waits for its step: core 1's step, already sent, is still sampled and
    taken; a request it finished comes out of the next `step()`, and the engine goes on with
    the same tokens as without the interruption (the workers' calls stay paired)."""
    args = EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory=1 << 24, data_parallel_size=2,
                      distributed_executor_backend="mp", async_scheduling=async_scheduling)
    short, long = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), GREEDY
    expected = [c.token_ids for o in LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24).generate(
        PROMPTS[:2], [long, short], use_tqdm=False) for c in o.outputs]
    engine = LLMEngine.from_engine_args(args)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, long)
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, short)
    assert engine.balancer.engine_of == {"a": 0, "b": 1}
    calls, result = [0], StepFuture.result
    interrupt_at = 3  # core 0's wait in the step where "b" finishes (core 1's is the 4th)

    def interrupted(self):
        calls[0] += 1
        if calls[0] == interrupt_at:
            raise KeyboardInterrupt
        return result(self)

    monkeypatch.setattr(StepFuture, "result", interrupted)
    finished = {}
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "b" not in finished  # taken from core 1, not yet delivered
    engine.abort_request(["a"])  # its step was lost
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["b"].outputs[0].token_ids == expected[1]
    engine.add_request("c", {"prompt_token_ids": PROMPTS[0]}, long)
    engine.add_request("d", {"prompt_token_ids": PROMPTS[1]}, short)
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finished[i].outputs[0].token_ids for i in "cd"] == expected
    assert all(not core.scheduler.num_steps_in_flight and not core.batch_queue for core in engine.engine_cores)
    engine.shutdown()
