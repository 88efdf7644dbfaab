"""AsyncLLM with a real engine-core process: streaming, concurrency, abort, n > 1,
errors, and a core that dies."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory=1 << 24))
    yield eng
    eng.shutdown()


async def _collect(eng, prompt, params, request_id):
    outs = [out async for out in eng.generate(prompt, params, request_id)]
    return outs


def test_streams_cumulative_outputs_equal_to_offline(engine, tiny_llama):
    outs = asyncio.run(_collect(engine, [5, 6, 7], GREEDY, "s1"))
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 9))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    offline = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 22).generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == offline[0].outputs[0].token_ids
    assert outs[-1].outputs[0].text == offline[0].outputs[0].text


def test_concurrent_requests_all_complete(engine):
    async def run():
        return await asyncio.gather(*[_collect(engine, [5, 6, 7 + i], GREEDY, f"c{i}") for i in range(32)])

    results = asyncio.run(run())
    assert all(r[-1].finished and len(r[-1].outputs[0].token_ids) == 8 for r in results)


def test_closing_the_stream_aborts_and_frees_blocks(engine):
    async def run():
        gen = engine.generate([5, 6], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), "long")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()
        for _ in range(50):  # the abort travels to the core asynchronously
            stats = await engine.get_stats()
            if stats["num_running"] == 0:
                return stats
            await asyncio.sleep(0.05)
        return stats

    stats = asyncio.run(run())
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_n_samples_and_validation(engine):
    outs = asyncio.run(_collect(engine, [5, 6], SamplingParams(temperature=1.0, n=3, seed=3, max_tokens=5), "n3"))
    assert len(outs[-1].outputs) == 3 and [c.index for c in outs[-1].outputs] == [0, 1, 2]
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(_collect(engine, [5] * 5000, GREEDY, "too-long"))


def test_dead_core_fails_requests_clearly(tiny_llama):
    eng = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory=1 << 22))

    async def run():
        gen = eng.generate([5, 6], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), "d")
        first = await gen.__anext__()
        os.kill(eng.client.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await eng.check_health()
        with pytest.raises(EngineDeadError):
            await _collect(eng, [5], GREEDY, "after")
        return first

    try:
        assert asyncio.run(run()).outputs[0].token_ids
    finally:
        eng.shutdown()
