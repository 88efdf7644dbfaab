"""The "mp" backend: the rank runs in a worker process of its own, reached by collective_rpc over
ZMQ. Same tokens as in-process; a stuck worker is a TimeoutError, a dead one an error within
seconds, and shutdown (or garbage collection) leaves no worker process behind."""

from __future__ import annotations

import gc
import os
import signal
import time

import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor.abstract import WorkerDiedError
from pagedllm.executor.multiproc_executor import MultiprocExecutor
from tests.utils import worker_ranks

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _llm(model: str, backend: str) -> LLM:
    return LLM(model, dtype="float32", kv_cache_memory=1 << 24, distributed_executor_backend=backend)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def mp_llm():
    """model -> an engine on `_llm(model, "mp")`, started once for the tests that leave it working
    (a worker process takes seconds to start); shut down after the module."""
    built: dict[str, LLM] = {}

    def get(model: str) -> LLM:
        if model not in built:
            built[model] = _llm(model, "mp")
        return built[model]

    yield get
    for llm in built.values():
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(autouse=True, scope="module")
def one_grammar_compiler():
    """One grammar compiler process per engine, not two: test_grammar_and_speculation_cross_to_the_worker
    compiles one grammar (tests/structured_output/test_grammar_compile_jam.py tests the default two)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_GRAMMAR_COMPILE_WORKERS", "1")
        yield


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_same_tokens_as_in_process(arch, request, mp_llm):
    model = request.getfixturevalue(arch)
    expected = _tokens(_llm(model, "uni"))
    llm = mp_llm(model)
    executor = llm.llm_engine.engine_core.model_executor
    assert isinstance(executor, MultiprocExecutor) and executor.worker_pids[0] != os.getpid()
    assert _tokens(llm) == expected


def test_timeout_dead_worker_and_cleanup(tiny_llama):
    llm = _llm(tiny_llama, "mp")
    executor = llm.llm_engine.engine_core.model_executor
    pid = executor.worker_pids[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError, match="did not answer within 0.5 s"):
            executor.collective_rpc("check_health", timeout=0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    # The late reply to check_health is dropped, not taken for the next call's answer.
    num_blocks = llm.llm_engine.engine_core.config.cache_config.num_blocks
    assert executor.collective_rpc("determine_num_blocks", timeout=10) == [num_blocks]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="died with exit code -9"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 5
    executor.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_garbage_collection_stops_the_worker(tiny_llama):
    llm = _llm(tiny_llama, "mp")
    pid = llm.llm_engine.engine_core.model_executor.worker_pids[0]
    assert psutil.pid_exists(pid)
    del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the worker outlived its engine"
        time.sleep(0.1)


def test_async_llm_with_a_worker_process(tiny_llama):
    """Front → engine-core process → worker process; a killed worker fails the engine, not hangs it."""
    import asyncio

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.exceptions import EngineDeadError

    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory=1 << 24,
                                                  distributed_executor_backend="mp"))
    try:
        async def run(prompt, request_id):
            return [out async for out in engine.generate(prompt, GREEDY, request_id)][-1]

        final = asyncio.run(run(PROMPTS[0], "a"))
        assert final.outputs[0].token_ids == _tokens(_llm(tiny_llama, "uni"))[0]
        core = psutil.Process(engine.client.proc.pid)
        workers = worker_ranks(core.pid)
        assert len(workers) == 1
        workers[0].kill()
        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(run(PROMPTS[1], "b"), timeout=30))
    finally:
        engine.shutdown()
    assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE


def test_grammar_and_speculation_cross_to_the_worker(tiny_llama):
    """The bitmask (filled while the worker runs the forward pass) and n-gram drafts reach the worker."""
    from pagedllm.sampling_params import StructuredOutputsParams

    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = [SamplingParams(temperature=0, max_tokens=12, structured_outputs=choice),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    results = {}
    for backend in ("uni", "mp"):
        llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24, distributed_executor_backend=backend,
                  speculative_config=spec)
        outs = llm.generate([[5, 6, 5, 6, 5, 6], [7, 8, 7, 8, 7]], params, use_tqdm=False)
        results[backend] = [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]
        llm.llm_engine.engine_core.shutdown()
    assert results["mp"] == results["uni"] and results["mp"][0][0] in ("yes", "no")


def test_preemption_and_samples_reach_the_worker_as_diffs(tiny_llama):
    """A KV cache too small for the batch preempts requests (sent whole again on resume) and n = 3
    samples fork one prompt: the worker process rebuilds every step from the messages alone."""
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, n=3, max_tokens=24, ignore_eos=True, presence_penalty=0.5)]
    prompts = [list(range(5, 25)), list(range(30, 47))]
    results = {}
    for backend in ("uni", "mp"):
        llm = LLM(tiny_llama, dtype="float32", block_size=8, num_gpu_blocks_override=14, max_model_len=64,
                  distributed_executor_backend=backend)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[backend] = [[c.token_ids for c in o.outputs] for o in outs]
        preemptions = llm.llm_engine.get_stats()["num_preemptions"]
        llm.llm_engine.engine_core.shutdown()
    assert preemptions > 0
    assert results["mp"] == results["uni"]


def test_logits_processors_need_the_in_process_worker(tiny_llama, mp_llm):
    llm = mp_llm(tiny_llama)
    with pytest.raises(ValueError, match="cannot reach worker processes"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=2, logits_processors=[lambda ids, logits: logits]),
                     use_tqdm=False)
    assert _tokens(llm) == _tokens(_llm(tiny_llama, "uni"))
