"""Async scheduling: step N + 1 is scheduled (and, with worker processes, sent) before step N's
tokens are back; the workers fill in the tokens they sampled. Outputs must not change: greedy and
seeded tokens, logprobs, stops in the middle of a step in flight, preemption, grammars (whose
bitmask for N + 1 must see step N's token), worker processes, and the server."""

from __future__ import annotations

import asyncio
from functools import partial

import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.abstract import StepFuture
from tests.structured_output.conftest import assert_valid, params
from tests.utils import assert_idle

PROMPTS = [list(range(5, 45)), list(range(50, 63)), [7, 8, 9], [11, 12], [20, 21, 22, 23]]


def _params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1, logprobs=2),
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.3, min_tokens=4,
                       bad_words=[]),
        SamplingParams(temperature=0, max_tokens=1),
        # Stops at its first `stop_token`, while the step after it is already scheduled.
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token], min_tokens=2),
    ]


ENGINE = dict(dtype="float32", block_size=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """A synchronous and an asynchronous engine with `_run`'s settings, {async_scheduling: LLM},
    shared by the tests that need no others (the asynchronous one's worker process takes
    seconds to start). One grammar compiler process each: test_grammar_sees_the_token_in_flight
    needs no more (tests/structured_output/test_grammar_compile_jam.py tests the default two)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_GRAMMAR_COMPILE_WORKERS", "1")
        built = {a: LLM(tiny_llama, kv_cache_memory=1 << 24, async_scheduling=a, **ENGINE) for a in (False, True)}
    yield built
    for llm in built.values():
        llm.llm_engine.shutdown()


def _run(model: str | LLM, async_scheduling: bool, prompts, sampling, **kw):
    """Outputs and the most output placeholders any request had just after a schedule(). `model`:
    a path (a new engine, shut down after) or one of `engines` (left running)."""
    if isinstance(model, LLM):
        assert not kw and model.llm_engine.engine_core.scheduler.async_scheduling == async_scheduling
        llm = model
    else:
        kw.setdefault("kv_cache_memory", 1 << 24)
        llm = LLM(model, async_scheduling=async_scheduling, **ENGINE, **kw)
    core = llm.llm_engine.engine_core
    scheduler, schedule = core.scheduler, core.scheduler.schedule
    most = [0]

    def counting_schedule():
        out = schedule()
        for r in scheduler.running:  # nothing is scheduled past the request's end
            assert r.num_output_tokens + r.num_output_placeholders <= r.max_tokens
            assert r.num_tokens + r.num_output_placeholders <= scheduler.max_model_len
            most[0] = max(most[0], r.num_output_placeholders)
        return out

    scheduler.schedule = counting_schedule
    try:
        outs = llm.generate(prompts, sampling, use_tqdm=False)
    finally:
        del scheduler.schedule
    assert not core.batch_queue and not scheduler.requests
    assert_idle(llm)
    result = [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]
    stats = llm.llm_engine.get_stats()
    if llm is not model:
        llm.llm_engine.shutdown()
    return result, [o.prompt_logprobs for o in outs], stats, most[0]


@pytest.fixture(scope="module")
def stop_token(engines) -> int:
    """A token the last prompt's greedy answer has at its 6th position (and not before)."""
    (out,) = engines[False].generate([PROMPTS[-1]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                                     use_tqdm=False)
    tokens = out.outputs[0].token_ids
    return next(t for i, t in enumerate(tokens) if i >= 5 and t not in tokens[:i])


# Data parallel cores schedule asynchronously each on its own, as one rank does
# (test_interrupted_wait_leaves_the_engine_usable[dp2], tests/engine/test_data_parallel.py).
LAYOUTS = pytest.mark.parametrize("layout", [{}, dict(tensor_parallel_size=2)], ids=["one_rank", "tp2"])


@LAYOUTS
def test_same_outputs_as_sync(tiny_llama, engines, stop_token, layout):
    sampling = _params(stop_token)
    if layout:  # TP's all-reduce rounds its own way
        expected = _run(tiny_llama, False, PROMPTS, sampling, **layout)
        got = _run(tiny_llama, True, PROMPTS, sampling, **layout)
    else:
        expected, got = (_run(engines[a], a, PROMPTS, sampling) for a in (False, True))
    assert got[:2] == expected[:2]
    assert expected[3] == 0 and got[3] == 2  # step N + 1 was scheduled with step N's token pending
    stopped = got[0][-1][0]
    assert stopped[1] == "stop" and 2 < len(stopped[0]) < 30


def test_max_tokens_and_max_model_len_are_not_overrun(tiny_llama):
    """A request whose last token is in flight is not scheduled again."""
    prompts = [list(range(5, 25)), [7, 8, 9]]
    sampling = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)]
    expected = _run(tiny_llama, False, prompts, sampling, max_model_len=24)
    got = _run(tiny_llama, True, prompts, sampling, max_model_len=24)
    assert got[0] == expected[0]
    assert [len(o[0][0]) for o in got[0]] == [2, 21] and got[0][1][0][1] == "length"


def test_reused_request_id_waits_for_the_step_in_flight(engines):
    """A request stopping at step N still has a row in step N + 1; a new request with its id,
    added meanwhile, waits for that step instead of taking the row's token."""
    greedy = partial(SamplingParams, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in engines[False].generate(
        [[5, 6, 7], [20, 21, 22, 23, 24], [9, 10, 11, 12]], [greedy(max_tokens=1), greedy(max_tokens=6),
                                                             greedy(max_tokens=12)], use_tqdm=False)]
    engine: LLMEngine = engines[True].llm_engine
    core = engine.engine_core
    # Its first token stops it, which the scheduler cannot know in advance.
    engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, greedy(max_tokens=8, stop_token_ids=expected[0]))
    engine.add_request("y", {"prompt_token_ids": [9, 10, 11, 12]}, greedy(max_tokens=12))
    final = {}
    while "x" not in final:
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["x"].outputs[0].token_ids == expected[0]
    assert core.scheduler.num_steps_in_flight.get("x")  # its row in the step after is in flight
    engine.add_request("x", {"prompt_token_ids": [20, 21, 22, 23, 24]}, greedy(max_tokens=6))
    assert "x" in core.scheduler.deferred
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert [final[i].outputs[0].token_ids for i in ("x", "y")] == expected[1:]
    assert not core.scheduler.deferred and not core.scheduler.num_steps_in_flight
    assert_idle(engines[True])


@pytest.mark.parametrize("layout", [{}, dict(data_parallel_size=2)], ids=["one_rank", "dp2"])
def test_interrupted_wait_leaves_the_engine_usable(tiny_llama, monkeypatch, layout):
    """Ctrl-C while the engine core waits for a step: generate() aborts its requests, and the next
    call gives the same outputs as before (the workers' forward and sampling calls stay paired,
    also those of the data-parallel cores whose step the interrupted one came before)."""
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24, async_scheduling=True, **layout)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    calls, result = [0], StepFuture.result

    def interrupted(self):
        calls[0] += 1
        if calls[0] == 3:  # with two data-parallel cores: core 0, whose core 1 has a step to sample
            raise KeyboardInterrupt
        return result(self)

    monkeypatch.setattr(StepFuture, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    assert_idle(llm)
    llm.llm_engine.shutdown()


def test_preemption(tiny_llama):
    prompts = PROMPTS[:3]
    sampling = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=40, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.5)]
    expected = _run(tiny_llama, False, prompts, sampling, num_gpu_blocks_override=16, max_model_len=96)
    got = _run(tiny_llama, True, prompts, sampling, num_gpu_blocks_override=16, max_model_len=96)
    assert got[2]["num_preemptions"] > 0
    assert got[:2] == expected[:2]


def test_grammar_sees_the_token_in_flight(engines):
    """The bitmask of step N + 1 is built after step N's token advanced the grammar."""
    tok = engines[False].get_tokenizer()
    kinds = ["json", "regex", "choice", "grammar"]
    prompts = [("Hello, my name is", "The quick brown fox")[i % 2] for i in range(len(kinds))]
    sampling = [params(kind, tok, temperature=0, max_tokens=120) for kind in kinds]
    expected, got = (_run(engines[a], a, prompts, sampling) for a in (False, True))
    assert got[0] == expected[0]
    for i, out in enumerate(got[0]):
        assert out[0][1] == "stop"
        assert_valid(kinds[i], tok.decode(out[0][0], skip_special_tokens=True))


def test_runs_in_worker_processes(tiny_llama):
    """One rank goes to a worker process (in-process, nothing would run beside the engine core)."""
    config = EngineArgs(model=tiny_llama, async_scheduling=True).create_engine_config()
    assert config.parallel_config.distributed_executor_backend == "mp"
    with pytest.raises(ValueError, match="worker processes"):
        EngineArgs(model=tiny_llama, async_scheduling=True, distributed_executor_backend="uni").create_engine_config()


def test_rejected_with_pipeline_parallel_or_speculation(tiny_llama):
    with pytest.raises(ValueError, match="pipeline parallel"):
        EngineArgs(model=tiny_llama, async_scheduling=True, pipeline_parallel_size=2,
                   distributed_executor_backend="mp").create_engine_config()
    with pytest.raises(ValueError, match="speculative"):
        EngineArgs(model=tiny_llama, async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config()


def test_server(tiny_llama, tmp_path_factory):
    """`pagedllm serve --async-scheduling`: concurrent completions match the synchronous engine,
    and requests cancelled mid-stream leave no KV blocks behind."""
    from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, metrics_once_idle, serve_tiny

    prompts = [f"Request number {i} says" for i in range(8)]
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24, max_model_len=256)
    expected = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)]
    llm.llm_engine.shutdown()
    serving = serve_tiny(tiny_llama, tmp_path_factory, extra_args=("--async-scheduling",))
    url = next(serving)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)

    async def complete(prompt: str) -> str:
        r = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text

    async def cancel_mid_stream(prompt: str) -> None:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=200, stream=True,
                                                 extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()

    async def run() -> list[str]:
        texts = await asyncio.gather(*(complete(p) for p in prompts))
        await asyncio.gather(*(cancel_mid_stream(p) for p in prompts[:4]))
        return texts

    try:
        assert asyncio.run(run()) == expected
        metrics_once_idle(url)
    finally:
        serving.close()


def test_pooling(tiny_llama):
    """Pooling requests sample nothing: no placeholder, the same vectors."""
    texts = [f"sentence {i} " * (1 + i % 7) for i in range(12)]
    vectors = []
    for async_scheduling in (False, True):
        llm = LLM(tiny_llama, runner="pooling", dtype="float32", kv_cache_memory=1 << 24,
                  async_scheduling=async_scheduling)
        vectors.append([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        assert_idle(llm)
        llm.llm_engine.shutdown()
    assert vectors[0] == vectors[1]
