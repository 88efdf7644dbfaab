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
    """n > 1: the siblings wait for the first sample's prompt to be cached, then take
    references on its full blocks instead of computing their own copies."""
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
    assert stats["prefix_cache_hits"] == 3 * 32
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
