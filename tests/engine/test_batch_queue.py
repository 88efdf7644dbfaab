"""The engine core's batch queue (pipeline parallel keeps one step in flight per stage): the next
step is scheduled before the previous one's output arrives. Tokens must not change: chunked
prefills continue, sampling requests wait for their token, samples of n > 1 fork, the running
requests are split over the steps in flight, and no request is preempted while its step is in
flight."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = [list(range(5, 45)), list(range(50, 63)), [7, 8, 9]]
PARAMS = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1),
          SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.3)]


def _run(model: str, queue_size: int, **kw):
    llm = LLM(model, dtype="float32", block_size=8, max_num_batched_tokens=16, **kw)
    core = llm.llm_engine.engine_core
    core.batch_queue_size = core.scheduler.pipeline_depth = queue_size  # as pipeline_parallel_size would
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert not core.batch_queue
    return [[c.token_ids for c in o.outputs] for o in outs], outs[0].prompt_logprobs, llm.llm_engine.get_stats()


@pytest.mark.parametrize("queue_size", [2, 3])
def test_steps_in_flight_give_the_same_tokens(tiny_llama, queue_size):
    tokens, prompt_logprobs, _ = _run(tiny_llama, 1, kv_cache_memory=1 << 24)
    assert _run(tiny_llama, queue_size, kv_cache_memory=1 << 24)[:2] == (tokens, prompt_logprobs)


def test_preemption_with_steps_in_flight(tiny_llama):
    expected = _run(tiny_llama, 1, num_gpu_blocks_override=16, max_model_len=96)
    tokens, prompt_logprobs, stats = _run(tiny_llama, 2, num_gpu_blocks_override=16, max_model_len=96)
    assert stats["num_preemptions"] > 0
    assert (tokens, prompt_logprobs) == expected[:2]
