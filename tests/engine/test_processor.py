"""The front end's request processing, without an engine: a structured-output schema is checked,
then shared by the request's copies (one per sample), never deep-copied."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.engine.processor import Processor, fan_out
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


def _processor() -> Processor:
    config = SimpleNamespace(text_config=SimpleNamespace(vocab_size=100), max_model_len=64)
    return Processor(config, tokenizer=None, eos_token_ids=[0])


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_samples_share_the_schema():
    schema = _nested(40)
    params = SamplingParams(n=3, temperature=1.0, stop=["x"], structured_outputs=StructuredOutputsParams(json=schema))
    request, _ = _processor().process_inputs("r", [1, 2, 3], params)
    children = [child.sampling_params for _, child in fan_out(request)]
    assert len(children) == 3 and all(c.structured_outputs.json is schema for c in children)
    assert request.sampling_params.all_stop_token_ids == {0} and params.all_stop_token_ids == set()  # caller untouched
    children[0].stop.append("y")
    assert children[1].stop == params.stop == ["x"]


def test_a_schema_deeper_than_the_stack_is_a_value_error():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=_nested(5000)))
    with pytest.raises(ValueError):
        _processor().process_inputs("r", [1, 2, 3], params)
