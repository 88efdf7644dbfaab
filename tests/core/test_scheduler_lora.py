"""The scheduler and LoRA adapters: never more distinct adapters running than --max-loras (the
workers' slots), the other adapters' requests wait (the queue goes on past them), and the prefix
cache keys blocks by adapter. Runs through the Driver, so the messages carry the adapters."""

from __future__ import annotations

from pagedllm.lora_request import LoRARequest
from tests.core.conftest import Driver, assert_all_blocks_free, make_req, make_scheduler

LORAS = [LoRARequest(f"a{i}", i + 1, f"/adapters/a{i}") for i in range(3)]


def test_running_adapters_never_exceed_max_loras():
    sched = make_scheduler()
    sched.max_loras = 2
    reqs = []
    for i in range(9):
        r = make_req(f"r{i}", 6, max_tokens=3 + i % 3)
        r.lora_request = LORAS[i % 3] if i % 4 else None  # base-model requests too
        reqs.append(r)
        sched.add_request(r)
    driver = Driver(sched)
    by_id = {r.request_id: r for r in reqs}
    seen_together = set()
    while sched.has_unfinished_requests():
        view = driver.step()
        running = {r.lora_request.lora_int_id for r in sched.running if r.lora_request is not None}
        assert len(running) <= 2, running
        stepped = {s.lora_request.lora_int_id for s in view.scheduled if s.lora_request is not None}
        assert len(stepped) <= 2
        seen_together |= stepped
        for s in view.scheduled:  # the worker holds each request's adapter
            assert s.lora_request == by_id[s.req_id].lora_request
    assert seen_together == {1, 2, 3} and all(r.is_finished() for r in reqs)
    assert_all_blocks_free(sched)


def test_an_adapter_waiting_for_a_slot_does_not_block_the_queue():
    sched = make_scheduler()
    sched.max_loras = 1
    first, blocked, base = make_req("first", 6, max_tokens=6), make_req("blocked", 6), make_req("base", 6)
    first.lora_request, blocked.lora_request = LORAS[0], LORAS[1]
    for r in (first, blocked, base):
        sched.add_request(r)
    view = Driver(sched).step()
    assert set(view.num_scheduled_tokens) == {"first", "base"}
    assert [r.request_id for r in sched.waiting] == ["blocked"]


def test_prefix_cache_keys_blocks_by_adapter():
    sched = make_scheduler()
    prompt = list(range(100, 116))
    runs = [(None, "base"), (LORAS[0], "a"), (LORAS[0], "a again"), (LORAS[1], "b")]
    cached = {}
    driver = Driver(sched)
    for lora, name in runs:
        r = make_req(name, prompt, max_tokens=1)
        r.lora_request = lora
        sched.add_request(r)
        driver.run()
        cached[name] = r.num_cached_tokens
    assert cached == {"base": 0, "a": 0, "a again": 12, "b": 0}
