"""The scheduler with n > 1: the samples of one request are admitted together after one prefill,
fork its prompt blocks, run in waves beyond max_num_seqs, and survive preemption and aborts."""

from __future__ import annotations

import pytest

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from tests.core.conftest import BS, EOS, FILLER, Driver, assert_all_blocks_free, make_req, make_scheduler


def make_group(parent_id: str, n: int, prompt: list[int], **kw) -> list[Request]:
    """What the front end's fan-out sends: one request per sample, in one group."""
    reqs = [make_req(f"{i}_{parent_id}", prompt, **kw) for i in range(n)]
    for r in reqs:
        r.group_id = parent_id
    return reqs


def add_group(sched: Scheduler, parent_id: str, n: int, prompt: list[int], **kw) -> list[Request]:
    """make_group, every sample added to the scheduler."""
    group = make_group(parent_id, n, prompt, **kw)
    for r in group:
        sched.add_request(r)
    return group


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("prompt_len", [8, 9, 10])
def test_n_samples_admitted_together_after_one_prefill(prompt_len, prefix_caching):
    sched = make_scheduler(prefix_caching=prefix_caching)
    group = add_group(sched, "p", 8, list(range(100, 100 + prompt_len)), max_tokens=3)
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
    assert sched.kv_cache_manager.groups == {}


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_admitted_together_when_the_first_finishes_at_once(prefix_caching):
    """The first sample finishing in its prefill step (max_tokens=1, or EOS) used to hand the
    group to the next sibling, which made the rest wait again: one sibling per step."""
    sched = make_scheduler(prefix_caching=prefix_caching)
    group = add_group(sched, "p", 8, list(range(100, 110)), max_tokens=1)
    d = Driver(sched)
    d.step()
    assert "0_p" in d.finished
    d.step()
    assert d.scheduled(1) == {r.request_id: 1 for r in group[1:]}
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


def test_request_behind_waiting_samples_is_admitted():
    sched = make_scheduler()
    add_group(sched, "p", 8, list(range(100, 110)), max_tokens=3)
    sched.add_request(make_req("solo", 5, max_tokens=3))
    d = Driver(sched)
    d.step()
    assert d.scheduled(0) == {"0_p": 10, "solo": 5}  # the siblings wait, the queue behind them does not
    d.run()


def test_n_samples_beyond_max_num_seqs_run_in_waves():
    """A wave after the first sample finished still forks its prompt: the group holds it."""
    sched = make_scheduler(max_num_seqs=3)
    group = add_group(sched, "p", 8, list(range(100, 110)), max_tokens=2)
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
    group = add_group(sched, "p", 4, list(range(100, 110)), max_tokens=12)
    d = Driver(sched)  # checks every step that each request reads only K/V that was written for it
    d.run()
    assert sched.num_preemptions > 0
    expected = [FILLER + i for i in range(12)]
    assert all(r.output_token_ids == expected for r in group)
    assert sched.kv_cache_manager.groups == {}


def test_abort_all_samples_frees_their_blocks_and_the_group():
    sched = make_scheduler(max_num_seqs=3)
    group = add_group(sched, "p", 6, list(range(100, 110)), max_tokens=3)
    d = Driver(sched)
    d.step()
    d.step()  # the first sample decodes, two forked it (max_num_seqs), three wait on the group's blocks
    assert len(sched.running) == 3 and sched.kv_cache_manager.groups["p"].prompt_blocks is not None
    sched.finish_requests([r.request_id for r in group], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and sched.kv_cache_manager.groups == {}
    assert_all_blocks_free(sched)


def test_group_prompt_holds_never_block_the_queue():
    """Samples waiting on held prompt blocks behind a request that needs those blocks: the
    holds are dropped rather than leaving the queue stuck."""
    sched = make_scheduler(num_blocks=8, max_model_len=40)
    groups = [add_group(sched, f"g{g}", 2, list(range(100 + 50 * g, 106 + 50 * g)), max_tokens=25) for g in range(6)]
    d = Driver(sched)
    d.run(max_steps=400)
    assert sched.num_preemptions > 0
    assert all(r.num_output_tokens == 25 for group in groups for r in group)
    assert sched.kv_cache_manager.groups == {}


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
    assert sched.kv_cache_manager.groups == {}
