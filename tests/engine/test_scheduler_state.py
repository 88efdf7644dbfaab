"""EngineCore.get_scheduler_state on a real tiny engine: the block map and queues it reports are
the scheduler's and the block pool's own, and survive the trip to the front (msgspec)."""

from __future__ import annotations

import msgspec
import pytest

from pagedllm import EngineArgs, LLMEngine, SamplingParams
from pagedllm.core.scheduler_state import scheduler_snapshot


@pytest.fixture()
def engine(tiny_llama):
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory=1 << 22, max_num_seqs=2))


def _check_against_pool(state, core):
    kv = core.scheduler.kv_cache_manager
    pool = kv.block_pool
    states = state["block_states"]
    assert state["num_blocks"] == pool.num_blocks == len(states) and not state["blocks_truncated"]
    assert state["num_free_blocks"] == pool.get_num_free_blocks() == states.count("f") + states.count("c")
    assert states.count("u") == sum(b.ref_cnt > 0 for b in pool.blocks)
    assert states.count("c") == sum(b.ref_cnt == 0 and b.block_hash is not None for b in pool.blocks)
    owned = set()
    for req in state["requests"]:
        assert req["block_ids"] == kv.get_block_ids(req["id"]) and req["num_blocks"] == len(req["block_ids"])
        owned.update(req["block_ids"])
    assert all(states[b] == "u" for b in owned)
    assert owned == {b.block_id for b in pool.blocks if b.ref_cnt > 0}  # no sample-group holds here


def test_snapshot_matches_the_scheduler(engine):
    core = engine.engine_core
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", list(range(10, 60)), params)
    engine.add_request("b", list(range(5, 25)), params)
    engine.add_request("c", [7, 8, 9], params)
    for _ in range(3):
        engine.step()
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(core.get_scheduler_state()))
    _check_against_pool(state, core)
    by_id = {r["id"]: r for r in state["requests"]}
    assert [r["id"] for r in state["requests"]] == ["a", "b", "c"]
    assert [by_id[i]["queue"] for i in "abc"] == ["running", "running", "waiting"]  # max_num_seqs=2
    a, c = by_id["a"], by_id["c"]
    assert (a["prompt_tokens"], a["prompt_computed"], a["output_tokens"], a["max_tokens"]) == (50, 50, 3, 40)
    assert a["computed_tokens"] == 52 and a["status"] == "running" and a["lora"] is None
    assert a["arrival_time"] <= a["first_token_time"] <= state["timestamp"]
    assert c["first_token_time"] is None and c["block_ids"] == [] and c["prompt_computed"] == 0
    assert state["stats"]["num_running"] == 2 and state["stats"]["num_waiting"] == 1

    core.scheduler._preempt(core.scheduler.running[-1])  # as when blocks run out: "b" loses its blocks
    state = core.get_scheduler_state()
    _check_against_pool(state, core)
    b = next(r for r in state["requests"] if r["id"] == "b")
    assert (b["queue"], b["status"], b["num_preemptions"], b["block_ids"]) == ("preempted", "preempted", 1, [])
    assert b["output_tokens"] == 3 and b["first_token_time"] is not None  # its first token came before

    while engine.has_unfinished_requests():
        engine.step()
    state = core.get_scheduler_state()
    _check_against_pool(state, core)
    assert state["requests"] == [] and "u" not in state["block_states"] and "c" in state["block_states"]


def test_block_map_is_capped(engine):
    engine.add_request("a", list(range(10, 60)), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    scheduler = engine.engine_core.scheduler
    full = scheduler.snapshot()
    capped = scheduler_snapshot(scheduler.kv_cache_manager, scheduler.running, scheduler.waiting, max_cells=3)
    assert capped["blocks_truncated"] and capped["num_blocks"] == full["num_blocks"] > 3
    assert capped["block_states"] == full["block_states"][:3]
    (req,) = capped["requests"]
    assert req["block_ids"] == [b for b in full["requests"][0]["block_ids"] if b < 3]
    assert req["num_blocks"] == full["requests"][0]["num_blocks"]
