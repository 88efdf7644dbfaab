"""Step-level control through LLMEngine: add, step, abort, priorities."""

from __future__ import annotations

import pytest

from pagedllm import EngineArgs, LLMEngine, SamplingParams


@pytest.fixture()
def engine(tiny_llama):
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory=1 << 22))


def _drain(engine):
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_step_api_and_abort(engine):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", "Hello, my name is", params)
    engine.add_request("c", list(range(10, 50)), params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1, 2], params)
    outs = engine.step()  # first step: prefills; every request gets its first token
    assert {o.request_id for o in outs} == {"a", "b", "c"}
    assert all(len(o.outputs[0].token_ids) == 1 and not o.finished for o in outs)
    engine.abort_request(["b"])
    assert engine.get_num_unfinished_requests() == 2
    finished = _drain(engine)
    assert set(finished) == {"a", "c"}
    assert all(len(o.outputs[0].token_ids) == 20 for o in finished.values())
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_streaming_outputs_grow(engine):
    engine.add_request("s", [3, 4, 5], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    lengths = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths.append(len(out.outputs[0].token_ids))
    assert lengths == [1, 2, 3, 4, 5]


def test_priority_scheduling(tiny_llama):
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=tiny_llama, kv_cache_memory=1 << 22, max_num_seqs=1, scheduling_policy="priority")
    )
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("low", [5, 6], params, priority=10)
    engine.add_request("high", [7, 8], params, priority=-1)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_priority_needs_priority_policy(engine):
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("x", [5], SamplingParams(), priority=3)


def test_parallel_samples_share_prompt_blocks(tiny_llama):
    """n > 1: the siblings wait for the first sample's prefill, then take references on its
    full blocks and a copy of its partial last one instead of computing their own."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory=1 << 22))
    prompt = list(range(10, 50))  # 40 tokens: 2 full blocks of 16 + 8
    engine.add_request("p", prompt, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=3, ignore_eos=True))
    shared_refs = []
    finished = None
    while engine.has_unfinished_requests():
        kv = engine.engine_core.scheduler.kv_cache_manager
        blocks = [kv.req_to_blocks.get(f"{i}_p", []) for i in range(4)]
        if all(blocks):
            shared_refs.append([b.ref_cnt for b in blocks[0][:2]])
            assert all(b[:2] == blocks[0][:2] for b in blocks), "siblings hold different prompt blocks"
        for out in engine.step():
            if out.finished:
                finished = out
    assert shared_refs and shared_refs[0] == [4, 4]
    assert len(finished.outputs) == 4
    stats = engine.get_stats()
    assert stats["prefix_cache_hits"] == 3 * 39  # each sibling computes only the last prompt token
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def _steps_until_finished(engine, request_ids: set[str], max_steps: int = 200) -> dict[str, int]:
    """The step (1-based) at which each request finished."""
    done: dict[str, int] = {}
    for step in range(1, max_steps + 1):
        done.update((o.request_id, step) for o in engine.step() if o.finished)
        if request_ids <= set(done):
            return done
    raise AssertionError(f"not finished after {max_steps} steps: {request_ids - set(done)}")


@pytest.mark.parametrize("max_tokens", [1, 8])
def test_n_samples_finish_in_about_max_tokens_steps(engine, max_tokens):
    """One prefill step, then every sample decodes in the same steps."""
    n = 16
    engine.add_request("p", list(range(10, 50)), SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens,
                                                                ignore_eos=True))
    steps = _steps_until_finished(engine, {"p"})["p"]
    assert steps <= 1 + max_tokens
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize(("n_max_tokens", "steps_before"), [(1, 0), (8, 1)])
def test_request_sent_during_n_request_is_not_starved(engine, n_max_tokens, steps_before):
    solo = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("alone", [5, 6, 7, 8], solo)
    alone = _steps_until_finished(engine, {"alone"})["alone"]
    engine.add_request("p", list(range(10, 50)), SamplingParams(n=16, temperature=1.0, seed=0,
                                                                max_tokens=n_max_tokens, ignore_eos=True))
    for _ in range(steps_before):
        engine.step()
    engine.add_request("solo", [5, 6, 7, 8], solo)
    done = _steps_until_finished(engine, {"p", "solo"})
    assert done["solo"] <= alone + 1
    assert done["p"] <= 1 + n_max_tokens


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forked_samples_match_single_requests(tiny_llama, prefix_caching):
    """Sample i of an n request is the request alone with seed + i: the forked samples read
    the first sample's prompt K/V (shared blocks and a copied partial block) correctly."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory=1 << 22,
                                                   enable_prefix_caching=prefix_caching))
    prompt = list(range(10, 50))  # 2 full blocks of 16 + 8 tokens
    common = dict(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=0)
    engine.add_request("p", prompt, SamplingParams(n=4, seed=11, **common))
    samples = _drain(engine)["p"].outputs
    for i, sample in enumerate(samples):
        engine.add_request(f"s{i}", prompt, SamplingParams(seed=11 + i, **common))
        single = _drain(engine)[f"s{i}"].outputs[0]
        assert sample.token_ids == single.token_ids
        assert sample.cumulative_logprob == pytest.approx(single.cumulative_logprob, abs=1e-4)
    assert len({tuple(s.token_ids) for s in samples}) == 4


def test_max_n_rejects_more_samples(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory=1 << 22, max_n=4))
    engine.add_request("ok", [5, 6], SamplingParams(n=4, temperature=1.0, max_tokens=1))
    with pytest.raises(ValueError, match=r"^n \(5\) .*max_n \(4\)"):
        engine.add_request("n", [5, 6], SamplingParams(n=5, temperature=1.0, max_tokens=1))
    with pytest.raises(ValueError, match=r"^best_of \(5\) .*max_n \(4\)"):
        engine.add_request("best_of", [5, 6], SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=1))
    assert set(_drain(engine)) == {"ok"}  # the rejected ones left nothing behind
    with pytest.raises(ValueError, match="max_n"):
        EngineArgs(model=tiny_llama, max_n=0).create_engine_config()


def test_n_request_gives_one_output_per_step(engine):
    """The samples' outputs of a step are fanned in once, not once per sample (O(n^2))."""
    engine.add_request("p", [5, 6, 7], SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True))
    last = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert len(outs) <= 1
        last = outs[-1] if outs else last
    assert last.finished and [len(c.token_ids) for c in last.outputs] == [3] * 8


def test_first_scheduled_time_and_tokens_per_step(tiny_llama):
    """The core stamps when a request was first scheduled (sent with its first token) and counts
    the tokens of each step: with chunked prefill (4 tokens a step) and no prefix cache, each prompt
    token once and each generated token but the last."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory=1 << 22, max_num_seqs=1,
                                                   max_num_batched_tokens=4, enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(10, 20)), params)
    engine.add_request("b", [5, 6, 7], params)
    finished = _drain(engine)
    a, b = finished["a"].metrics, finished["b"].metrics
    for m in (a, b):
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert b.first_scheduled_time >= a.last_token_time  # max_num_seqs=1: b waited for a
    stats = engine.get_stats()
    assert stats["iteration_tokens_sum"] == (10 + 3 - 1) + (3 + 3 - 1)
    assert stats["iteration_tokens_count"] == 3 + 2 + 1 + 2  # a: 3 prefill chunks, 2 decodes; b: 1 and 2
    assert stats["iteration_tokens_bucket:1"] == 4 and stats["iteration_tokens_bucket:8"] == 8


def test_shutdown_gives_back_the_workers_hold_on_malloc(engine):
    """In-process engines shut down on request: the CPU worker lets go of its malloc hold."""
    worker = engine.engine_core.model_executor.driver_worker
    if not worker.keeps_freed_memory:
        pytest.skip("no hold taken here (not glibc, or the user's malloc settings)")
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert not worker.keeps_freed_memory and worker.model_runner is None


def _outputs_of(engine, prompt, params) -> list:
    engine.add_request("k", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "k"]
    return outs


@pytest.mark.parametrize("n", [1, 3])
def test_output_kinds_carry_the_same_answer(engine, n):
    """CUMULATIVE: everything so far per step; DELTA: only what is new (the samples a step
    touched), adding up to the same text, tokens and logprobs; FINAL_ONLY: one output, the end."""
    from pagedllm.sampling_params import RequestOutputKind

    def params(kind):
        return SamplingParams(n=n, temperature=0.8, seed=7, max_tokens=12, logprobs=2, stop=["e"],
                              output_kind=kind)
    cumulative = _outputs_of(engine, "Hello, my name is", params(RequestOutputKind.CUMULATIVE))
    final = {c.index: c for c in cumulative[-1].outputs}
    assert len(cumulative) > 1 and all(len(o.outputs) == n for o in cumulative)

    [only] = _outputs_of(engine, "Hello, my name is", params(RequestOutputKind.FINAL_ONLY))
    assert only.finished and {c.index: (c.text, c.token_ids) for c in only.outputs} == {
        i: (c.text, c.token_ids) for i, c in final.items()}

    deltas = _outputs_of(engine, "Hello, my name is", params(RequestOutputKind.DELTA))
    assert len(deltas) == len(cumulative) and deltas[-1].finished
    text, tokens, logprobs = {}, {}, {}
    for out in deltas:
        for c in out.outputs:
            text[c.index] = text.get(c.index, "") + c.text
            tokens[c.index] = tokens.get(c.index, []) + c.token_ids
            logprobs[c.index] = logprobs.get(c.index, []) + c.logprobs
    assert sum(len(c.token_ids) for o in deltas for c in o.outputs) == sum(len(c.token_ids) for c in final.values())
    for i, c in final.items():
        assert (text[i], tokens[i], logprobs[i]) == (c.text, c.token_ids, c.logprobs)


def test_output_kind_is_checked():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)
