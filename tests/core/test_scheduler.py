"""The V1 scheduler driven directly with Request objects and a fake model runner (the Driver of
conftest.py): the token budget and chunked prefill, aborts, stop conditions, prefix caching, and
a randomized run of all of it. Preemption and priorities: test_scheduler_preemption.py; n > 1:
test_scheduler_n.py; speculative decoding: test_scheduler_spec.py."""

from __future__ import annotations

import pytest

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput
from tests.core.conftest import EOS, FILLER, Driver, assert_all_blocks_free, make_req, make_scheduler


# ---- budget and chunked prefill ------------------------------------------------
def test_token_budget_respected_every_step():
    sched = make_scheduler(max_num_batched_tokens=8)
    for i, n in enumerate([13, 5, 21, 3, 9]):
        sched.add_request(make_req(f"r{i}", n, max_tokens=5))
    d = Driver(sched)
    d.run()
    assert len(d.finished) == 5
    assert all(r.num_output_tokens == 5 for r in d.finished.values())
    assert all(r.get_finished_reason() == "length" for r in d.finished.values())
    totals = [o.total_num_scheduled_tokens for o in d.outputs]
    assert max(totals) == 8  # the budget is used, never exceeded
    # Every token of every prompt was computed (no prefix sharing here), plus decodes.
    assert sum(totals) == (13 + 5 + 21 + 3 + 9) + 5 * 4


def test_long_prompt_is_chunked_across_steps():
    sched = make_scheduler(max_num_batched_tokens=6)
    req = make_req("a", 14, max_tokens=2)
    sched.add_request(req)
    d = Driver(sched)
    chunks = []
    for _ in range(3):
        out = d.step()
        (s,) = out.scheduled
        chunks.append((s.start_pos, len(s.token_ids), s.sample))
    assert chunks == [(0, 6, False), (6, 6, False), (12, 2, True)]
    assert req.output_token_ids == [FILLER]
    assert req.num_computed_tokens == 14
    (s,) = d.step().scheduled  # decode
    assert (s.start_pos, s.token_ids, s.sample) == (14, [FILLER], True)
    assert req.get_finished_reason() == "length"
    assert_all_blocks_free(sched)


def test_decode_and_prefill_chunk_share_a_step():
    sched = make_scheduler(max_num_batched_tokens=6)
    a = make_req("a", 3, max_tokens=10)
    sched.add_request(a)
    d = Driver(sched)
    d.step()  # a's whole prompt
    assert a.num_output_tokens == 1
    b = make_req("b", 20, max_tokens=1)
    sched.add_request(b)
    out = d.step()
    by_id = {s.req_id: s for s in out.scheduled}
    assert [s.req_id for s in out.scheduled] == ["a", "b"]
    assert len(by_id["a"].token_ids) == 1 and by_id["a"].sample
    assert (by_id["b"].start_pos, len(by_id["b"].token_ids), by_id["b"].sample) == (0, 5, False)
    out = d.step()
    assert d.scheduled(2) == {"a": 1, "b": 5}
    assert [s.start_pos for s in out.scheduled] == [4, 5]
    d.run()


def test_long_prefill_token_threshold_caps_each_request_s_chunk():
    """Two prompts arrive beside a decode: each computes at most 5 tokens a step (not the
    budget's 64), so the decode shares every step with small chunks; the last chunk is the rest."""
    sched = make_scheduler(long_prefill_token_threshold=5)
    a = make_req("a", 3, max_tokens=8)
    sched.add_request(a)
    d = Driver(sched)
    d.step()
    sched.add_request(make_req("b", 12, max_tokens=2))
    sched.add_request(make_req("c", 4, max_tokens=2))
    for _ in range(3):
        d.step()
    assert [d.scheduled(i) for i in (1, 2, 3)] == [
        {"a": 1, "b": 5, "c": 4}, {"a": 1, "b": 5, "c": 1}, {"a": 1, "b": 2}]
    d.run()
    assert len(d.finished) == 3 and max(o.total_num_scheduled_tokens for o in d.outputs) <= 11
    assert_all_blocks_free(sched)


def test_max_num_seqs_respected():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_req(f"r{i}", 5, max_tokens=3) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    d = Driver(sched)
    out = d.step()
    assert [s.req_id for s in out.scheduled] == ["r0", "r1"]
    assert len(sched.waiting) == 2
    d.run()
    assert all(len(o.scheduled) <= 2 for o in d.outputs)
    first_step = {}
    for i, o in enumerate(d.outputs):
        for s in o.scheduled:
            first_step.setdefault(s.req_id, i)
    # r2 and r3 only start once r0 and r1 are done (3 steps each).
    assert first_step == {"r0": 0, "r1": 0, "r2": 3, "r3": 3}


def test_running_requests_scheduled_before_waiting():
    sched = make_scheduler(max_num_batched_tokens=2)
    a = make_req("a", 2, max_tokens=4)
    sched.add_request(a)
    d = Driver(sched)
    d.step()
    b = make_req("b", 3, max_tokens=1)
    sched.add_request(b)
    # a decodes first each step; b only gets what is left of the budget.
    out = d.step()
    assert [(s.req_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 1)]
    sched2 = make_scheduler(max_num_batched_tokens=1)
    a2 = make_req("a", 1, max_tokens=4)
    sched2.add_request(a2)
    d2 = Driver(sched2)
    d2.step()
    sched2.add_request(make_req("b", 3, max_tokens=1))
    for _ in range(3):  # b starves while a is running and takes the whole budget
        assert d2.step().scheduled[0].req_id == "a"
        assert sched2.requests["b"].status == RequestStatus.WAITING
    assert a2.is_finished()
    assert d2.step().scheduled[0].req_id == "b"
    d2.run()


def test_chunked_prefill_of_waiting_request_resumes_before_new_ones():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = make_req("a", 10, max_tokens=1)
    b = make_req("b", 3, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    d = Driver(sched)
    assert d.step().scheduled[0].req_id == "a"
    # a (running, mid-prefill) keeps priority over b.
    assert d.scheduled(0) == {"a": 4}
    d.step()
    assert d.scheduled(1) == {"a": 4}
    d.step()
    assert d.scheduled(2) == {"a": 2, "b": 2}
    d.run()


# ---- abort --------------------------------------------------------------------------
def test_abort_running_request_frees_blocks():
    sched = make_scheduler(num_blocks=10)
    a, b = make_req("a", 9, max_tokens=10), make_req("b", 5, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    d = Driver(sched)
    d.step()
    kv = sched.kv_cache_manager
    held_by_a = len(kv.get_block_ids("a"))
    assert held_by_a == 3
    free_before = kv.get_num_free_blocks()
    finished = sched.finish_requests(["a", "nonexistent"], RequestStatus.FINISHED_ABORTED)
    assert finished == [a]
    assert a.get_finished_reason() == "abort"
    assert kv.get_num_free_blocks() == free_before + held_by_a
    assert sched.running == [b]
    assert "a" not in sched.requests
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []  # only once
    out = d.step()
    assert out.finished_req_ids == {"a"}
    assert [s.req_id for s in out.scheduled] == ["b"]
    assert d.step().finished_req_ids == set()  # reported once
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


def test_finished_ids_of_an_empty_step_reach_the_workers_with_the_next_step():
    """A step with nothing scheduled is not sent, so the ids it would carry wait for one that is."""
    sched = make_scheduler()
    sched.add_request(make_req("a", 5))
    d = Driver(sched)
    d.step()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().is_empty  # nothing to run: the workers hear nothing
    sched.add_request(make_req("b", 5))
    out = d.step()
    assert out.finished_req_ids == {"a"} and "a" not in d.worker.batch.requests


def test_abort_waiting_and_preempted_requests():
    sched = make_scheduler(num_blocks=4)
    reqs = [make_req(n, 4, max_tokens=3) for n in ("a", "b", "c")]
    waiting = make_req("w", 4)
    for r in reqs:
        sched.add_request(r)
    d = Driver(sched)
    d.step()
    d.step()
    assert reqs[2].status == RequestStatus.PREEMPTED
    sched.add_request(waiting)
    finished = sched.finish_requests(["c", "w"], RequestStatus.FINISHED_ABORTED)
    assert finished == [reqs[2], waiting]
    assert len(sched.waiting) == 0
    assert sched.get_num_unfinished_requests() == 2
    d.run()
    assert set(d.finished) == {"a", "b"}


# ---- stop conditions -------------------------------------------------------------------
def _run_one(req: Request, script: list[int], **sched_kwargs) -> Request:
    sched = make_scheduler(**sched_kwargs)
    sched.add_request(req)
    d = Driver(sched, {req.request_id: script})
    d.run()
    return req


def test_eos_stops():
    req = _run_one(make_req("a", 5, max_tokens=10), [7, 8, EOS, 9, 9])
    assert req.output_token_ids == [7, 8, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.get_finished_reason() == "stop"
    assert req.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    req = _run_one(make_req("a", 5, max_tokens=4, ignore_eos=True), [EOS] * 4)
    assert req.output_token_ids == [EOS] * 4
    assert req.get_finished_reason() == "length"


def test_stop_token_ids_set_stop_reason():
    req = _run_one(make_req("a", 5, max_tokens=10, stop_token_ids=[42]), [7, 42, 8])
    assert req.output_token_ids == [7, 42]
    assert req.get_finished_reason() == "stop"
    assert req.stop_reason == 42


def test_stop_token_ids_apply_even_with_ignore_eos():
    req = _run_one(
        make_req("a", 5, max_tokens=10, stop_token_ids=[42], ignore_eos=True), [EOS, 42, 8]
    )
    assert req.output_token_ids == [EOS, 42]
    assert req.stop_reason == 42


def test_max_tokens_gives_length():
    req = _run_one(make_req("a", 5, max_tokens=3), [7, 8, 9, 10, 11])
    assert req.output_token_ids == [7, 8, 9]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.get_finished_reason() == "length"
    assert req.stop_reason is None


def test_min_tokens_suppresses_eos_and_stop_tokens():
    req = _run_one(
        make_req("a", 5, max_tokens=10, min_tokens=3, stop_token_ids=[42]), [EOS, 42, 7, EOS, 9]
    )
    assert req.output_token_ids == [EOS, 42, 7, EOS]
    assert req.get_finished_reason() == "stop"
    req = _run_one(make_req("b", 5, max_tokens=10, min_tokens=2), [EOS, EOS, 5])
    assert req.output_token_ids == [EOS, EOS]


def test_min_tokens_does_not_extend_max_tokens():
    req = _run_one(make_req("a", 5, max_tokens=3, min_tokens=3), [7, 8, 9, 10])
    assert req.output_token_ids == [7, 8, 9]
    assert req.get_finished_reason() == "length"


def test_max_model_len_caps_generation():
    req = _run_one(make_req("a", 5, max_tokens=100), list(range(10, 20)), max_model_len=8)
    assert req.num_tokens == 8
    assert req.output_token_ids == [10, 11, 12]
    assert req.get_finished_reason() == "length"


def test_updated_and_finished_returned_from_update():
    sched = make_scheduler()
    a, b = make_req("a", 3, max_tokens=1), make_req("b", 3, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    outputs = sched.update_from_output(out, ModelRunnerOutput(["a", "b"], [[7], [8]]))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("a", [7], "length"),
        ("b", [8], None),
    ]
    assert a.is_finished() and not b.is_finished()
    assert sched.running == [b]
    assert sched.get_num_unfinished_requests() == 1


def test_eos_on_last_allowed_token_is_length():
    """vLLM checks the length cap first."""
    sched = make_scheduler(num_blocks=16)
    req = make_req("a", 4, max_tokens=2)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[50]]))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[EOS]]))
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


# ---- prefix caching through the scheduler -------------------------------------------------
def test_second_request_reuses_prefix_and_all_blocks_free_at_end():
    sched = make_scheduler(num_blocks=16)
    shared = list(range(100, 112))  # 3 blocks
    a = make_req("a", shared + [1, 3], max_tokens=2)
    sched.add_request(a)
    d = Driver(sched)
    d.run()
    b = make_req("b", shared + [5], max_tokens=2)
    sched.add_request(b)
    out = d.step()
    (s,) = out.scheduled
    assert s.start_pos == 12 and s.token_ids == [5]
    assert b.num_cached_tokens == 12
    assert sched.kv_cache_manager.prefix_cache_stats.hits == 12
    d.run()


def test_blocked_waiting_request_counts_one_prefix_lookup():
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=64)
    sched.add_request(make_req("big", 10, max_tokens=1))  # takes all 3 blocks of 4
    sched.add_request(make_req("next", 4, max_tokens=1))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["big"]
    assert sched.kv_cache_manager.prefix_cache_stats.requests == 1


# ---- everything at once ----------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_randomized_stress_all_blocks_free(policy: str):
    import random

    rng = random.Random(1234)
    sched = make_scheduler(num_blocks=12, max_num_batched_tokens=7, max_num_seqs=4, policy=policy)
    shared = list(range(300, 308))
    script: dict[str, list[int]] = {}
    for i in range(12):
        n = rng.randint(1, 14)
        prompt = (shared[: rng.choice([0, 4, 8])] + [rng.randint(10, 99) for _ in range(n)])
        rid = f"r{i}"
        script[rid] = [rng.choice([EOS, 3, 4, 5, 6]) for _ in range(9)]
        sched.add_request(make_req(rid, prompt, max_tokens=9, priority=rng.randint(0, 3),
                                   arrival_time=float(i)))
    d = Driver(sched, script)
    for _ in range(4):
        d.step()
    unfinished = [rid for rid in ("r5", "r0", "r11") if rid in sched.requests]
    assert unfinished, "the abort must hit live requests"
    aborted = sched.finish_requests(unfinished, RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in aborted] == unfinished
    d.run()
    assert sched.num_preemptions > 0
    assert set(d.finished) == {f"r{i}" for i in range(12)} - set(unfinished)
    for rid, req in d.finished.items():
        out = req.output_token_ids
        assert out == script[rid][: len(out)]
        assert (out[-1] == EOS) or len(out) == 9
