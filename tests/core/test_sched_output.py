"""The step message the scheduler sends its workers: a request whole once, then only diffs
(tokens sampled since, new blocks, num_computed_tokens); a preempted request whole again; and
all of it through msgspec without loss."""

from __future__ import annotations

import msgspec

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from tests.core.conftest import BS, make_req, make_scheduler


def _run(sched, message: SchedulerOutput, tokens: dict[str, list[int]]) -> None:
    ids = list(message.num_scheduled_tokens)
    sched.update_from_output(message, ModelRunnerOutput(ids, [tokens.get(i) for i in ids]))


def test_new_request_is_sent_once_then_as_diffs():
    sched = make_scheduler()
    req = make_req("a", 6, max_tokens=10)  # BS = 4: two blocks for the prompt
    sched.add_request(req)
    first = sched.schedule()
    (new,) = first.scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.num_computed_tokens) == ("a", req.prompt_token_ids, 0)
    assert new.block_ids == sched.kv_cache_manager.get_block_ids("a") and len(new.block_ids) == 2
    assert not first.scheduled_cached_reqs.req_ids and first.num_scheduled_tokens == {"a": 6}
    _run(sched, first, {"a": [70]})

    second = sched.schedule()  # decode of 70 at position 6: still in the second block
    assert not second.scheduled_new_reqs
    cached = second.scheduled_cached_reqs
    assert (cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens) == (
        ["a"], [[70]], [[]], [6])
    _run(sched, second, {"a": [71]})
    third = sched.schedule()  # position 7, then 8 needs a third block
    _run(sched, third, {"a": [72]})
    fourth = sched.schedule()
    assert fourth.scheduled_cached_reqs.new_token_ids == [[72]]
    assert fourth.scheduled_cached_reqs.new_block_ids == [sched.kv_cache_manager.get_block_ids("a")[2:]]
    assert len(fourth.scheduled_cached_reqs.new_block_ids[0]) == 1


def test_preempted_request_is_sent_whole_again_with_its_outputs():
    sched = make_scheduler(num_blocks=3)  # room for 12 tokens
    a, b = make_req("a", 4, max_tokens=8), make_req("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step = sched.schedule()
    _run(sched, step, {"a": [50], "b": [60]})
    preempted_at = None
    for i in range(8):
        step = sched.schedule()
        if step.preempted_req_ids:
            preempted_at = i
            break
        _run(sched, step, {r: [51 + i] for r in step.num_scheduled_tokens})
    assert preempted_at is not None and step.preempted_req_ids == {"b"}
    assert "b" not in step.num_scheduled_tokens
    _run(sched, step, {"a": [90]})
    # b comes back once a finishes: as a new request that carries the outputs it had.
    for _ in range(20):
        step = sched.schedule()
        resumed = [n for n in step.scheduled_new_reqs if n.req_id == "b"]
        if resumed:
            break
        _run(sched, step, {r: [EOS_FREE] for r in step.num_scheduled_tokens})
    (new_b,) = resumed
    assert new_b.output_token_ids == b.output_token_ids and new_b.output_token_ids[0] == 60
    assert new_b.num_computed_tokens == 0 and step.num_scheduled_tokens["b"] == b.num_tokens


EOS_FREE = 400


def test_message_round_trips_through_msgspec():
    sched = make_scheduler()
    params = dict(logit_bias={3: 1.5}, stop=["x"], seed=7,
                  structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    req = make_req("a", 2 * BS + 1, max_tokens=5, **params)
    req.structured_output = None
    sched.requests[req.request_id] = req
    sched.waiting.add(req)
    message = sched.schedule()
    message.block_copies.append((1, 2))
    message.finished_req_ids.add("gone")
    wire = msgspec.msgpack.encode(message)
    decoded = msgspec.msgpack.decode(wire, type=SchedulerOutput)
    assert decoded == message
    sp = decoded.scheduled_new_reqs[0].sampling_params
    assert isinstance(sp, SamplingParams) and sp.logit_bias == {3: 1.5} and sp.seed == 7
    assert sp.structured_outputs.json == {"type": "object"}
