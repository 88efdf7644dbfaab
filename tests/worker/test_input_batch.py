"""The worker's InputBatch rebuilds each step's requests from the diffs: tokens across the
prompt / output boundary, drafts last, the sample flag, and dropping finished or preempted ones;
its rows hold tokens, block tables and sampling parameters, and the step's inputs gather from them."""

from __future__ import annotations

import torch

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.step_inputs import prepare_inputs

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
    assert a.block_ids == [7, 8, 9] and a.output_token_ids == [60, 61] and a.state.token_slice(4, 6) == [5, 60]


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


def _tokens(batch: InputBatch, req_id: str) -> list[int]:
    state = batch.requests[req_id]
    return batch.token_ids[state.row, : state.num_tokens].tolist()


def test_rows_hold_tokens_blocks_and_parameters_and_are_reused():
    batch = InputBatch(max_num_reqs=1, max_model_len=4, max_num_blocks=1)  # every array has to grow
    sampled = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, seed=2, logprobs=3,
                             presence_penalty=0.5, logit_bias={3: 1.0})
    batch.update_states(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3, 4, 5], PARAMS, [7, 8], 0),
                            NewRequestData("b", [6], sampled, [9, 12], 0, output_token_ids=[10, 11])],
        num_scheduled_tokens={"a": 5, "b": 3}))
    a, b = batch.requests["a"].row, batch.requests["b"].row
    assert _tokens(batch, "a") == [1, 2, 3, 4, 5] and _tokens(batch, "b") == [6, 10, 11]
    assert batch.block_table[a, : len(batch.requests["a"].block_ids)].tolist() == [7, 8]
    assert (batch.greedy[a], batch.temperature[a], batch.num_logprobs[a]) == (True, 1.0, -1)
    assert not (batch.seeded[a] or batch.reads_history[a] or batch.has_masks[a])
    assert batch.greedy[b] == False and batch.top_k[b] == 5 and batch.num_logprobs[b] == 3  # noqa: E712
    assert abs(batch.temperature[b] - 0.7) < 1e-6 and abs(batch.top_p[b] - 0.8) < 1e-6
    assert batch.seeded[b] and batch.reads_history[b] and batch.has_masks[b]
    # A decode step: the new token lands in the row, drafts after it, and the flat inputs come from the rows.
    (ra, rb) = batch.update_states(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a", "b"], [[20], [21]], [[30], [13]], [5, 3]),
        num_scheduled_tokens={"a": 1, "b": 3}, scheduled_spec_decode_tokens={"b": [40, 41]}))
    assert _tokens(batch, "a") == [1, 2, 3, 4, 5, 20] and _tokens(batch, "b") == [6, 10, 11, 21]
    assert batch.block_table[a, :3].tolist() == [7, 8, 30]
    step = batch.prepare_inputs([ra, rb], block_size=2, device=torch.device("cpu"))
    assert step.input_ids.tolist() == [20, 21, 40, 41] and step.positions.tolist() == [5, 3, 4, 5]
    assert step.attn_metadata.slot_mapping.tolist() == [30 * 2 + 1, 12 * 2 + 1, 13 * 2, 13 * 2 + 1]
    # A finished request's row goes to the next arrival, whose tokens overwrite it.
    batch.update_states(SchedulerOutput(
        finished_req_ids={"a"}, scheduled_new_reqs=[NewRequestData("c", [50, 51], PARAMS, [3], 0)],
        num_scheduled_tokens={"c": 2}))
    assert batch.requests["c"].row == a and _tokens(batch, "c") == [50, 51]
    assert batch.block_table[a, :3].tolist() == [3, 0, 0]  # none of a's blocks is left behind


def test_same_inputs_as_from_lists():
    """The rows' gather equals the list path the draft model and warm-up use."""
    batch = InputBatch()
    rows = batch.update_states(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", list(range(1, 12)), PARAMS, [4, 5, 6], 3),
                            NewRequestData("b", [7, 8], PARAMS, [2], 1, output_token_ids=[9])],
        num_scheduled_tokens={"a": 6, "b": 2}))
    got = batch.prepare_inputs(rows, 4, torch.device("cpu"))
    want = prepare_inputs([r.token_ids for r in rows], [r.start_pos for r in rows], [r.block_ids for r in rows],
                          4, torch.device("cpu"))
    assert got.input_ids.tolist() == want.input_ids.tolist() == list(range(4, 10)) + [8, 9]
    assert got.positions.tolist() == want.positions.tolist()
    assert got.attn_metadata.slot_mapping.tolist() == want.attn_metadata.slot_mapping.tolist()
    assert [p.block_table.tolist() for p in got.attn_metadata.prefills] == [
        p.block_table.tolist() for p in want.attn_metadata.prefills]
