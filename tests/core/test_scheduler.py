"""The V1 scheduler driven directly with Request objects and a fake model runner."""

from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

BS = 4
EOS = 2
FILLER = 500  # first token a request samples unless scripted; never EOS


def make_scheduler(
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    policy: str = "fcfs",
    prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            policy=policy,
        ),
        CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
    )


def make_req(
    req_id: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time: float = 0.0,
    **params,
) -> Request:
    if isinstance(prompt, int):
        # Distinct tokens per request, so prefixes are only shared when a test wants it.
        base = 1000 * (sum(map(ord, req_id)) + 1)
        prompt = list(range(base, base + prompt))
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, **params),
        eos_token_ids=frozenset({EOS}),
        priority=priority,
        arrival_time=arrival_time,
    )


class Driver:
    """Runs schedule -> fake forward -> update_from_output and checks invariants each step."""

    def __init__(self, sched: Scheduler, script: dict[str, list[int]] | None = None) -> None:
        self.sched = sched
        self.script = script or {}
        self.outputs: list[SchedulerOutput] = []
        self.finished: dict[str, Request] = {}
        self.kv_len: dict[str, int] = {}  # tokens the fake runner holds K/V for, per request
        # A simulated paged KV cache: (block_id, slot) -> the token prefix whose K/V it holds.
        self.kv_slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def next_token(self, req: Request) -> int:
        script = self.script.get(req.request_id)
        if script is not None:
            return script[req.num_output_tokens]
        return FILLER + req.num_output_tokens

    def step(self) -> SchedulerOutput:
        sched = self.sched
        out = sched.schedule()
        cfg = sched.config
        assert out.total_num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        assert len({s.req_id for s in out.scheduled}) == len(out.scheduled)
        for rid in out.preempted_req_ids:
            self.kv_len.pop(rid, None)
        # The runner copies forked blocks (n > 1 samples) before the forward pass.
        for src, dst in out.block_copies:
            for slot in range(BS):
                self.kv_slots.pop((dst, slot), None)
                if (src, slot) in self.kv_slots:
                    self.kv_slots[dst, slot] = self.kv_slots[src, slot]
        copied = {dst for _, dst in out.block_copies}
        tokens = []
        for s in out.scheduled:
            req = sched.requests[s.req_id]
            assert s.token_ids, "a scheduled request gets at least one token"
            assert s.token_ids == req.all_token_ids[s.start_pos : s.start_pos + len(s.token_ids)]
            end = s.start_pos + len(s.token_ids)
            assert len(s.block_ids) * BS >= end
            if s.req_id in self.kv_len:
                # A continuing request resumes exactly where its K/V ends.
                assert s.start_pos == self.kv_len[s.req_id]
            else:
                # A (re)started request begins at 0, after whole prefix-cached blocks, or in a
                # block copied for it this step.
                assert s.start_pos % BS == 0 or s.block_ids[s.start_pos // BS] in copied
                assert s.start_pos < req.num_tokens
            self.kv_len[s.req_id] = end
            # Everything before start_pos (computed earlier or a prefix-cache hit) must really
            # be in the request's blocks; then this step writes its own tokens.
            for pos in range(s.start_pos):
                slot = (s.block_ids[pos // BS], pos % BS)
                assert self.kv_slots.get(slot) == tuple(req.all_token_ids[: pos + 1]), (
                    f"{s.req_id} reuses position {pos} whose K/V was never written"
                )
            for pos in range(s.start_pos, end):
                self.kv_slots[(s.block_ids[pos // BS], pos % BS)] = tuple(req.all_token_ids[: pos + 1])
            assert s.sample == (end == req.num_tokens)
            tokens.append([self.next_token(req)] if s.sample else None)
        runner = ModelRunnerOutput([s.req_id for s in out.scheduled], tokens)
        by_id = {s.req_id: sched.requests[s.req_id] for s in out.scheduled}
        outputs = sched.update_from_output(out, runner)
        finished = [by_id[o.request_id] for o in outputs if o.finish_reason is not None]
        for req in finished:
            assert req.is_finished()
            self.finished[req.request_id] = req
            self.kv_len.pop(req.request_id)
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests(), "requests did not finish"
        assert_all_blocks_free(self.sched)

    def scheduled(self, step: int) -> dict[str, int]:
        return {s.req_id: len(s.token_ids) for s in self.outputs[step].scheduled}


def assert_all_blocks_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.block_pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.req_to_blocks == {} or all(not v for v in kv.req_to_blocks.values())


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


# ---- preemption -------------------------------------------------------------------
def test_fcfs_preempts_newest_running_request():
    sched = make_scheduler(num_blocks=4)
    reqs = [make_req(n, 4, max_tokens=3) for n in ("a", "b", "c")]
    for r in reqs:
        sched.add_request(r)
    d = Driver(sched)
    d.step()  # each prompt fills one block; one block left
    a, b, c = reqs
    assert sched.kv_cache_manager.get_num_free_blocks() == 1
    out = d.step()  # a and b both need a second block: c (newest) makes room
    assert out.preempted_req_ids == {"c"}
    assert [s.req_id for s in out.scheduled] == ["a", "b"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.kv_cache_manager.get_block_ids("c") == []
    assert list(sched.waiting) == [c]
    assert sched.running == [a, b]
    assert c.output_token_ids == [FILLER]  # its sampled token is kept
    d.run()
    assert c.output_token_ids == [FILLER, FILLER + 1, FILLER + 2]
    assert c.get_finished_reason() == "length"


def test_preempted_request_recomputes_from_zero():
    sched = make_scheduler(num_blocks=4, prefix_caching=False)
    a, b = make_req("a", 7, max_tokens=6), make_req("b", 6, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    d = Driver(sched)
    d.run()
    assert b.num_preemptions >= 1
    assert sched.num_preemptions >= 1
    # Find b's first schedule after its (last) preemption: it starts over at position 0
    # with the prompt plus the tokens it had already generated.
    i = max(i for i, o in enumerate(d.outputs) if "b" in o.preempted_req_ids)
    restart = next(s for o in d.outputs[i + 1 :] for s in o.scheduled if s.req_id == "b")
    assert restart.start_pos == 0
    assert len(restart.token_ids) > b.num_prompt_tokens
    assert restart.token_ids == b.all_token_ids[: len(restart.token_ids)]
    assert b.output_token_ids == [FILLER + k for k in range(6)]
    assert a.output_token_ids == [FILLER + k for k in range(6)]


def test_preemption_under_pressure_all_requests_finish():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=10)
    reqs = [make_req(f"r{i}", 3 + 2 * i, max_tokens=7) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    d = Driver(sched)
    d.run()
    assert sched.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == [FILLER + k for k in range(7)]
    # No step admits waiting requests while it is preempting.
    for o in d.outputs:
        if o.preempted_req_ids:
            assert not (o.preempted_req_ids & {s.req_id for s in o.scheduled})


def test_preemption_of_already_scheduled_request_with_prefix_caching():
    """Priority preemption of a request scheduled earlier in the same step: its blocks must
    only serve later prefix hits for K/V that was really computed (the Driver checks)."""
    sched = make_scheduler(num_blocks=6, policy="priority", max_num_batched_tokens=64)
    b = make_req("b", 4, max_tokens=12, priority=5)
    sched.add_request(b)
    d = Driver(sched)
    d.step()
    d.step()
    sched.add_request(make_req("a", 4, max_tokens=12, priority=0, arrival_time=1.0))
    sched.add_request(make_req("c", 4, max_tokens=12, priority=1, arrival_time=1.0))
    d.run()  # Driver asserts every restart begins inside computed K/V
    assert b.num_preemptions > 0
    assert len(d.finished) == 3
    assert b.output_token_ids == [FILLER + k for k in range(12)]


# ---- priority policy ---------------------------------------------------------------
def test_priority_lower_value_scheduled_first():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, prio, t in [("low", 9, 0.0), ("high", 0, 1.0), ("mid", 3, 2.0), ("mid2", 3, 3.0)]:
        sched.add_request(make_req(rid, 3, max_tokens=1, priority=prio, arrival_time=t))
    d = Driver(sched)
    d.run()
    order = [o.scheduled[0].req_id for o in d.outputs]
    assert order == ["high", "mid", "mid2", "low"]


def test_fcfs_ignores_priority():
    sched = make_scheduler(max_num_seqs=1, policy="fcfs")
    for rid, prio in [("first", 9), ("second", 0)]:
        sched.add_request(make_req(rid, 3, max_tokens=1, priority=prio))
    d = Driver(sched)
    d.run()
    assert [o.scheduled[0].req_id for o in d.outputs] == ["first", "second"]


def test_priority_preempts_largest_priority_value():
    sched = make_scheduler(num_blocks=4, policy="priority")
    b = make_req("b", 4, max_tokens=8, priority=5, arrival_time=0.0)
    sched.add_request(b)
    d = Driver(sched)
    d.step()  # b alone: 1 block
    a = make_req("a", 4, max_tokens=8, priority=0, arrival_time=1.0)
    c = make_req("c", 4, max_tokens=8, priority=1, arrival_time=2.0)
    sched.add_request(a)
    sched.add_request(c)
    d.step()  # b takes its second block, a and c one each: the pool is full
    assert sched.running == [b, a, c]
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    # Three decodes but a budget of two: only b's refunded token lets c run this step.
    sched.config.max_num_batched_tokens = 2
    out = d.step()
    # b is scheduled first (oldest running), then a needs a block: the victim is b, the
    # largest priority value, not c, the newest; b's budget is handed back.
    assert out.preempted_req_ids == {"b"}
    assert [s.req_id for s in out.scheduled] == ["a", "c"]
    assert out.total_num_scheduled_tokens == 2
    sched.config.max_num_batched_tokens = 64
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.running == [a, c]
    assert sched.kv_cache_manager.get_block_ids("b") == []
    d.run()
    assert all(r.num_output_tokens == 8 for r in (a, b, c))


def test_preempted_request_goes_back_to_front_of_fcfs_queue():
    sched = make_scheduler(num_blocks=4, max_num_seqs=3)
    reqs = [make_req(n, 4, max_tokens=3) for n in ("a", "b", "c", "d")]
    for r in reqs:
        sched.add_request(r)
    d = Driver(sched)
    d.step()  # a, b, c admitted; d waits
    out = d.step()
    assert out.preempted_req_ids == {"c"}
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    d.run()


def test_no_waiting_request_admitted_in_a_step_that_preempts():
    sched = make_scheduler(num_blocks=5, max_num_seqs=3, policy="priority")
    x = make_req("x", 4, max_tokens=4, priority=1, arrival_time=0.0)
    y = make_req("y", 4, max_tokens=4, priority=1, arrival_time=1.0)
    z = make_req("z", 8, max_tokens=4, priority=5, arrival_time=2.0)
    for r in (x, y, z):
        sched.add_request(r)
    d = Driver(sched)
    d.step()  # x, y: one block each; z: two; one block left
    dd = make_req("d", 3, max_tokens=4, priority=0, arrival_time=3.0)
    sched.add_request(dd)  # no seat free: waits
    out = d.step()
    # x takes the last block, y needs one more: z is preempted and frees two blocks. One
    # is left over and would fit d, but a step that preempts admits nothing new.
    assert out.preempted_req_ids == {"z"}
    assert [s.req_id for s in out.scheduled] == ["x", "y"]
    assert sched.kv_cache_manager.get_num_free_blocks() == 1
    assert dd.status == RequestStatus.WAITING
    out = d.step()
    assert [s.req_id for s in out.scheduled] == ["x", "y", "d"]
    d.run()
    assert z.num_output_tokens == 4 and z.num_preemptions == 1


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


def test_blocked_waiting_request_counts_one_prefix_lookup():
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=64)
    sched.add_request(make_req("big", 10, max_tokens=1))  # takes all 3 blocks of 4
    sched.add_request(make_req("next", 4, max_tokens=1))
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["big"]
    assert sched.kv_cache_manager.prefix_cache_stats.requests == 1


# ---- n > 1: the samples of one request ------------------------------------------------
def make_group(parent_id: str, n: int, prompt: list[int], **kw) -> list[Request]:
    """What the front end's fan-out sends: one request per sample, in one group."""
    reqs = [make_req(f"{i}_{parent_id}", prompt, **kw) for i in range(n)]
    for r in reqs:
        r.group_id = parent_id
    return reqs


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("prompt_len", [8, 9, 10])
def test_n_samples_admitted_together_after_one_prefill(prompt_len, prefix_caching):
    sched = make_scheduler(prefix_caching=prefix_caching)
    group = make_group("p", 8, list(range(100, 100 + prompt_len)), max_tokens=3)
    for r in group:
        sched.add_request(r)
    d = Driver(sched)
    d.step()
    assert d.scheduled(0) == {"0_p": prompt_len}  # one prefill of the prompt
    d.step()
    # Every sample runs in the step after it, each computing one token: the leader its first
    # output, the others their last prompt token.
    assert [r.request_id for r in sched.running] == [r.request_id for r in group]
    assert d.scheduled(1) == {r.request_id: 1 for r in group}
    kv = sched.kv_cache_manager
    tables = [kv.req_to_blocks[r.request_id] for r in group]
    num_full = (prompt_len - 1) // BS
    shared = tables[0][:num_full]
    assert shared and all(t[:num_full] == shared for t in tables)
    assert [b.ref_cnt for b in shared] == [8] * num_full
    # The block holding the rest of the prompt: one copy per sibling (none to copy when the
    # last prompt token starts a block).
    assert len({t[num_full].block_id for t in tables}) == 8
    assert len(d.outputs[1].block_copies) == (7 if (prompt_len - 1) % BS else 0)
    d.run()
    assert all(r.output_token_ids == [FILLER, FILLER + 1, FILLER + 2] for r in group)
    assert sched.groups == {}


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_admitted_together_when_the_first_finishes_at_once(prefix_caching):
    """The first sample finishing in its prefill step (max_tokens=1, or EOS) used to hand the
    group to the next sibling, which made the rest wait again: one sibling per step."""
    sched = make_scheduler(prefix_caching=prefix_caching)
    group = make_group("p", 8, list(range(100, 110)), max_tokens=1)
    for r in group:
        sched.add_request(r)
    d = Driver(sched)
    d.step()
    assert "0_p" in d.finished
    d.step()
    assert d.scheduled(1) == {r.request_id: 1 for r in group[1:]}
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


def test_request_behind_waiting_samples_is_admitted():
    sched = make_scheduler()
    for r in make_group("p", 8, list(range(100, 110)), max_tokens=3):
        sched.add_request(r)
    sched.add_request(make_req("solo", 5, max_tokens=3))
    d = Driver(sched)
    d.step()
    assert d.scheduled(0) == {"0_p": 10, "solo": 5}  # the siblings wait, the queue behind them does not
    d.run()


def test_n_samples_beyond_max_num_seqs_run_in_waves():
    """A wave after the first sample finished still forks its prompt: the group holds it."""
    sched = make_scheduler(max_num_seqs=3)
    group = make_group("p", 8, list(range(100, 110)), max_tokens=2)
    for r in group:
        sched.add_request(r)
    d = Driver(sched)
    d.run()
    first = {}
    for out in d.outputs:
        for s in out.scheduled:
            first.setdefault(s.req_id, len(s.token_ids))
    assert first == {"0_p": 10, **{r.request_id: 1 for r in group[1:]}}
    assert all(r.num_output_tokens == 2 for r in group)


def test_prompt_logprobs_sample_prefills_and_the_others_fork():
    sched = make_scheduler()
    group = make_group("p", 4, list(range(100, 110)), max_tokens=2)
    group[0].sampling_params.prompt_logprobs = 1  # the front end asks for them on sample 0 only
    for r in group:
        sched.add_request(r)
    d = Driver(sched)
    d.step()
    d.step()
    assert d.scheduled(0) == {"0_p": 10}
    assert d.scheduled(1) == {r.request_id: 1 for r in group}
    d.run()


def test_preempted_sample_does_not_break_its_siblings():
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=16)
    group = make_group("p", 4, list(range(100, 110)), max_tokens=12)
    for r in group:
        sched.add_request(r)
    d = Driver(sched)  # checks every step that each request reads only K/V that was written for it
    d.run()
    assert sched.num_preemptions > 0
    expected = [FILLER + i for i in range(12)]
    assert all(r.output_token_ids == expected for r in group)
    assert sched.groups == {}


def test_abort_all_samples_frees_their_blocks_and_the_group():
    sched = make_scheduler(max_num_seqs=3)
    group = make_group("p", 6, list(range(100, 110)), max_tokens=3)
    for r in group:
        sched.add_request(r)
    d = Driver(sched)
    d.step()
    d.step()  # the first sample decodes, two forked it (max_num_seqs), three wait on the group's blocks
    assert len(sched.running) == 3 and sched.groups["p"].prompt_blocks is not None
    sched.finish_requests([r.request_id for r in group], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and sched.groups == {}
    assert_all_blocks_free(sched)


def test_group_prompt_holds_never_block_the_queue():
    """Samples waiting on held prompt blocks behind a request that needs those blocks: the
    holds are dropped rather than leaving the queue stuck."""
    sched = make_scheduler(num_blocks=8, max_model_len=40)
    groups = [make_group(f"g{g}", 2, list(range(100 + 50 * g, 106 + 50 * g)), max_tokens=25) for g in range(6)]
    for group in groups:
        for r in group:
            sched.add_request(r)
    d = Driver(sched)
    d.run(max_steps=400)
    assert sched.num_preemptions > 0
    assert all(r.num_output_tokens == 25 for group in groups for r in group)
    assert sched.groups == {}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_randomized_groups_stress(policy, prefix_caching):
    """n > 1 groups with early stops, preemption, chunking, waves and aborts: the Driver checks
    every step that each sample reads only K/V written for its own tokens."""
    import random

    rng = random.Random(99)
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=9, max_num_seqs=5, policy=policy,
                           prefix_caching=prefix_caching)
    script: dict[str, list[int]] = {}
    groups = {}
    for g in range(6):
        prompt = [rng.randint(10, 99) for _ in range(rng.randint(1, 13))]
        group = make_group(f"g{g}", rng.randint(1, 5), prompt, max_tokens=10, priority=rng.randint(0, 2),
                           arrival_time=float(g))
        groups[f"g{g}"] = group
        for r in group:
            script[r.request_id] = [rng.choice([EOS, 3, 4, 5, 6, 7, 8, 9, 11]) for _ in range(10)]
            sched.add_request(r)
    d = Driver(sched, script)
    for _ in range(3):
        d.step()
    aborted = [r.request_id for r in groups["g1"] + groups["g4"] if r.request_id in sched.requests]
    sched.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
    d.run()
    assert sched.num_preemptions > 0 and any(out.block_copies for out in d.outputs)
    assert set(d.finished) == set(script) - set(aborted)
    for rid, req in d.finished.items():
        out = req.output_token_ids
        assert out == script[rid][: len(out)] and (out[-1] == EOS or len(out) == 10)
    assert sched.groups == {}
