"""SamplingParams itself: invalid values and types are ValueErrors (at construction, or at
generate() where the model's vocabulary decides), bad prompts likewise, and clone(). The
behaviour of each parameter through `LLM`: test_sampling_params_{logprobs,penalties,n,stop}.py."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.utils import assert_idle


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n must"),
        (dict(n=3, best_of=2, temperature=1.0), "best_of"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_p=2.0), "min_p"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_invalid_params_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (lambda v: dict(logit_bias={v: 1.0}), "logit_bias"),
        (lambda v: dict(allowed_token_ids=[3, v]), "allowed_token_ids"),
        (lambda v: dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (lambda v: dict(stop_token_ids=[v + 5]), "stop_token_ids"),
        (lambda v: dict(stop=["x"], detokenize=False), "stop"),
    ],
    ids=["logit_bias", "allowed_big", "allowed_negative", "stop_token_ids", "stop_without_detokenize"],
)
def test_invalid_params_raise_at_generate_time(llm, tok, kwargs, field):
    vocab = len(tok)
    params = SamplingParams(**kwargs(vocab))
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match=field):
        llm.generate(["Hello", "Hello again"], [good, params], use_tqdm=False)
    assert_idle(llm)  # the good request, added first, was dropped too
    assert len(llm.generate("Hello", good, use_tqdm=False)[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "0.5", None, True])
def test_non_finite_or_non_numeric_floats_raise(field, value):
    """NaN passed every range check (a NaN temperature sampled <pad> tokens); a string raised TypeError."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={5: float("nan")}), "logit_bias"),  # was clamped to +100 by the server: forced the token
    (dict(logit_bias={5: float("inf")}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={5: "high"}), "logit_bias"),
    (dict(max_tokens="16"), "max_tokens"),
    (dict(max_tokens=2**64), "max_tokens"),
    (dict(seed=2**63), "seed"),
    (dict(min_tokens=None), "min_tokens"),
    (dict(logprobs=1.5), "logprobs"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop=["ok", "\ud800"]), "stop"),
    (dict(bad_words=["a\udfffb"]), "bad_words"),
    (dict(bad_words=[5]), "bad_words"),
])
def test_invalid_values_and_types_raise_value_error(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, match", [
    ("caf\udce9", "not valid Unicode"),  # a lone surrogate: the tokenizer raised TypeError
    ([5, -1], "out of vocabulary"),
    ([5, 2**63], "out of vocabulary"),  # was an OverflowError
    ({"prompt_token_ids": [2**64 + 1]}, "out of vocabulary"),
    ({"prompt_token_ids": [True, 5]}, "out of vocabulary"),
])
def test_invalid_prompts_raise_value_error(llm, prompt, match):
    good = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match=match):
        llm.generate(["Hello", prompt], good, use_tqdm=False)
    assert_idle(llm)
    assert len(llm.generate("Hello", good, use_tqdm=False)[0].outputs[0].token_ids) == 2


# ---- clone and generation config ---------------------------------------------------------------------------------

def test_clone_copies_containers_and_shares_logits_processors():
    def proc(ids, logits):
        return logits

    p = SamplingParams(stop=["a"], stop_token_ids=[3], logit_bias={4: 1.0}, allowed_token_ids=[1, 2],
                       bad_words=["x"], logits_processors=[proc])
    c = p.clone()
    assert c == p
    assert c.logits_processors is p.logits_processors and c.logits_processors[0] is proc
    for name in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "all_stop_token_ids"):
        assert getattr(c, name) is not getattr(p, name), name
    c.stop.append("b")
    c.logit_bias[5] = 2.0
    c.allowed_token_ids.append(9)
    assert p.stop == ["a"] and p.logit_bias == {4: 1.0} and p.allowed_token_ids == [1, 2]
    assert p.logits_processors == [proc]


def test_clone_shares_a_deep_schema_and_never_walks_it():
    """A request's schema can nest far past Python's recursion limit: clone (once per request,
    once per sample) shares it read-only instead of deep-copying it."""
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    p = SamplingParams(n=2, temperature=1.0, structured_outputs=StructuredOutputsParams(json=schema))
    c = p.clone()
    assert c.structured_outputs is not p.structured_outputs and c.structured_outputs.json is schema
    c.structured_outputs.disable_any_whitespace = True
    assert p.structured_outputs.disable_any_whitespace is False
