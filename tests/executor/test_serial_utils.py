"""The executor's wire format: the step messages decode into their types, the grammar bitmask
tensor arrives bit for bit, and what cannot cross (a Python callable) is a clear error."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.sched_output import (
    CachedRequestData,
    GrammarOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.executor.serial_utils import MessageCodec
from pagedllm.sampling_params import SamplingParams


def test_step_messages_decode_into_their_types():
    codec = MessageCodec()
    sched = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2], SamplingParams(temperature=0.5, seed=3), [4], 0)],
        scheduled_cached_reqs=CachedRequestData(["b"], [[7]], [[]], [9]),
        num_scheduled_tokens={"a": 2, "b": 1}, total_num_scheduled_tokens=3, block_copies=[(1, 2)])
    call_id, method, args, kwargs = codec.decode_call(codec.encode_call(5, "execute_model", (sched,), {}))
    assert (call_id, method, kwargs) == (5, "execute_model", {}) and args == (sched,)

    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32)
    frames = codec.encode_call(6, "sample_tokens", (GrammarOutput({"a": 0}, bitmask),), {})
    _, _, (grammar,), _ = codec.decode_call(frames)
    assert grammar.structured_output_request_ids == {"a": 0} and torch.equal(grammar.grammar_bitmask, bitmask)
    assert codec.decode_call(codec.encode_call(7, "sample_tokens", (None,), {}))[2] == (None,)

    out = ModelRunnerOutput(["a", "b"], [None, [5]], logprobs=[None, [([5, 6], [-0.5, -1.0], 1)]])
    frames = codec.encode_reply(6, 0, True, out)
    assert codec.decode_reply_header(frames) == (6, 0, True)
    assert codec.decode_reply_value(frames, "sample_tokens", True) == out


def test_a_callable_cannot_cross():
    params = SamplingParams(logits_processors=[lambda ids, logits: logits])
    sched = SchedulerOutput(scheduled_new_reqs=[NewRequestData("a", [1], params, [0], 0)])
    with pytest.raises(TypeError, match="cannot be sent to a worker process"):
        MessageCodec().encode_call(1, "execute_model", (sched,), {})
