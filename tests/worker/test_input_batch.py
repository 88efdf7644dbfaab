"""The worker's InputBatch rebuilds each step's requests from the diffs: tokens across the
prompt / output boundary, drafts last, the sample flag, and dropping finished or preempted ones."""

from __future__ import annotations

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch

PARAMS = SamplingParams(temperature=0)


def test_diffs_rebuild_the_step():
    batch = InputBatch()
    (a,) = batch.update_states(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3, 4, 5], PARAMS, [7, 8], 0)],
        num_scheduled_tokens={"a": 3}))
    assert (a.token_ids, a.start_pos, a.sample) == ([1, 2, 3], 0, False)  # a prefill chunk
    (a,) = batch.update_states(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a"], [[]], [[]], [3]), num_scheduled_tokens={"a": 2}))
    assert (a.token_ids, a.start_pos, a.sample) == ([4, 5], 3, True)
    # Two sampled tokens arrive; the step computes the first one's K/V and two drafts after it.
    (a,) = batch.update_states(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a"], [[60, 61]], [[9]], [5]),
        num_scheduled_tokens={"a": 4}, scheduled_spec_decode_tokens={"a": [62, 63]}))
    assert a.token_ids == [60, 61, 62, 63] and a.spec_token_ids == [62, 63] and a.sample
    assert a.block_ids == [7, 8, 9] and a.output_token_ids == [60, 61] and a.token_slice(4, 6) == [5, 60]


def test_finished_and_preempted_requests_are_dropped_and_resumed_whole():
    batch = InputBatch()
    batch.update_states(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2], PARAMS, [0], 0), NewRequestData("b", [3], PARAMS, [1], 0)],
        num_scheduled_tokens={"a": 2, "b": 1}))
    assert batch.update_states(SchedulerOutput(finished_req_ids={"a"}, preempted_req_ids={"b"})) == []
    assert batch.requests == {}
    (b,) = batch.update_states(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("b", [3], PARAMS, [4], 0, output_token_ids=[9, 10])],
        num_scheduled_tokens={"b": 3}))
    assert b.token_ids == [3, 9, 10] and b.sample and b.block_ids == [4]
