"""Request → SamplingParams, logprobs formats, stream deltas, SSE framing and the async
helpers: pure functions, no server and no engine."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from pagedllm.engine.logprobs import Logprob
from pagedllm.entrypoints.chat_utils import ALLOWED_ROLES
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    DeltaMessage,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.response_utils import (
    DeltaTracker,
    chat_logprobs,
    completion_logprobs_with_end,
    output_usage,
    prompt_logprobs_json,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.entrypoints.openai.stream_utils import SSE_DONE, chunk_json, merge_async_iterators, peek_all, sse
from pagedllm.outputs import CompletionOutput, RequestOutput

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def serving(fake_engine) -> OpenAIServing:
    return OpenAIServing(fake_engine, ["fake-model", "alias"])


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MSGS, **kw)


def test_vllm_extra_fields_reach_sampling_params(serving):
    req = _chat(temperature=0.3, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                frequency_penalty=-0.5, seed=7, stop="END", stop_token_ids=[3], include_stop_str_in_output=True,
                ignore_eos=True, min_tokens=2, skip_special_tokens=False, spaces_between_special_tokens=False,
                truncate_prompt_tokens=10, allowed_token_ids=[5, 6, 7], bad_words=["bad"], n=2,
                logit_bias={"5": 150, "6": -3})
    p = serving.sampling_params(req, max_tokens=9, logprobs=3, prompt_logprobs=1)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.3, 0.9, 5, 0.05, 1.2)
    assert (p.presence_penalty, p.frequency_penalty, p.seed, p.n, p.best_of) == (0.5, -0.5, 7, 2, 2)
    assert p.stop == ["END"] and p.stop_token_ids == [3] and p.include_stop_str_in_output and p.ignore_eos
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (9, 2, 3, 1)
    assert not p.skip_special_tokens and not p.spaces_between_special_tokens
    assert p.truncate_prompt_tokens == 10 and p.allowed_token_ids == [5, 6, 7] and p.bad_words == ["bad"]
    assert p.logit_bias == {5: 100.0, 6: -3.0}  # string keys → ids, clamped to OpenAI's range


def test_openai_defaults_and_generation_config_defaults(serving):
    p = serving.sampling_params(_chat(), max_tokens=None, logprobs=None, prompt_logprobs=None)
    assert (p.temperature, p.top_p, p.top_k, p.n, p.max_tokens, p.logprobs) == (1.0, 1.0, 0, 1, None, None)
    serving.default_sampling = {"temperature": 0.6, "top_k": 20}
    p = serving.sampling_params(_chat(), max_tokens=None, logprobs=None, prompt_logprobs=None)
    assert (p.temperature, p.top_k) == (0.6, 20)
    p = serving.sampling_params(_chat(temperature=0), max_tokens=None, logprobs=None, prompt_logprobs=None)
    assert p.temperature == 0  # an explicit value beats the model's default


@pytest.mark.parametrize("kw, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 2, "temperature": 0}, None),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 50}, "min_tokens"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
])
def test_invalid_sampling_values_are_400_naming_the_field(serving, kw, param):
    with pytest.raises(OpenAIError) as e:
        serving.sampling_params(_chat(**kw), max_tokens=10, logprobs=None, prompt_logprobs=None)
    assert e.value.status == 400 and e.value.param == param
    body = e.value.to_body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == 400


def test_model_name_and_context_length_checks(serving):
    assert serving.model_name(None) == "fake-model" and serving.model_name("alias") == "alias"
    with pytest.raises(OpenAIError) as e:
        serving.model_name("gpt-4")
    assert e.value.status == 404 and "gpt-4" in e.value.message
    serving.check_length(10, 54)  # exactly max_model_len=64
    with pytest.raises(OpenAIError, match="maximum context length is 64") as e:
        serving.check_length(10, 55)
    assert e.value.param == "max_tokens"
    with pytest.raises(OpenAIError, match="no room"):
        serving.check_length(64, None)


def test_request_schema_accepts_all_prompt_shapes_and_unknown_fields():
    for prompt in ["a", ["a", "b"], [1, 2], [[1, 2], [3]]]:
        assert CompletionRequest(prompt=prompt).prompt == prompt
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                store=True, metadata={"k": "v"})
    assert req.messages[0].content == [{"type": "text", "text": "x"}]
    assert CompletionRequest(prompt="a").max_tokens == 16 and _chat().max_tokens is None
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])
    with pytest.raises(ValidationError):
        _chat(truncate_prompt_tokens=0)


@pytest.mark.parametrize("make", [
    lambda: CompletionRequest(prompt=[1, "5"]),  # token ids are JSON integers, never strings,
    lambda: CompletionRequest(prompt=[1, 2.0]),  # floats
    lambda: CompletionRequest(prompt=[True]),  # or booleans
    lambda: CompletionRequest(prompt=[[1], [-2]]),
    lambda: CompletionRequest(prompt="a", stop_token_ids=["3"]),
    lambda: CompletionRequest(prompt="a", allowed_token_ids=[-1]),
    lambda: DetokenizeRequest(tokens=["5"]),
    lambda: DetokenizeRequest(tokens=[-1]),
    lambda: CompletionRequest(prompt="a", max_tokens="5"),  # strict scalars, as OpenAI's API
    lambda: CompletionRequest(prompt="a", echo=1),
    lambda: CompletionRequest(prompt="a", temperature="0.5"),
    lambda: _chat(chat_template_kwargs="x"),
    lambda: _chat(chat_template_kwargs=[1]),
    lambda: ChatCompletionRequest(messages=[{"role": "robot", "content": "x"}]),
])
def test_request_types_are_strict(make):
    with pytest.raises(ValidationError):
        make()


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty", "length_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinity_are_rejected_in_float_fields(field, value):
    with pytest.raises(ValidationError, match="finite"):
        _chat(**{field: value})
    with pytest.raises(ValidationError, match="finite"):
        CompletionRequest(prompt="a", logit_bias={"5": value})
    assert _chat(**{field: 1}).model_dump()[field] == 1.0  # an integer is still a number


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"maximum": float("inf")}}}},
     "response_format.json_schema.schema.maximum"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"default": float("nan")}}}]},
     "tools.0.function.parameters.default"),
    ({"unknown_extra": [1, float("-inf")]}, "unknown_extra.1"),
])
def test_nan_anywhere_in_the_body_is_rejected(kw, param):
    with pytest.raises(ValidationError) as e:
        _chat(**kw)
    (err,) = e.value.errors()
    assert err["type"] == "pagedllm_invalid_value" and err["ctx"]["param"] == param


@pytest.mark.parametrize("make, param", [
    (lambda s: CompletionRequest(prompt=s), "prompt"),
    (lambda s: CompletionRequest(prompt=["ok", s]), "prompt.1"),
    (lambda s: CompletionRequest(prompt="a", stop=s), "stop"),
    (lambda s: CompletionRequest(prompt="a", stop=[s]), "stop.0"),
    (lambda s: CompletionRequest(prompt="a", bad_words=[s]), "bad_words.0"),
    (lambda s: ChatCompletionRequest(messages=[{"role": "user", "content": s}]), "messages.0.content"),
    (lambda s: ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": s}]}]),
     "messages.0.content.0.text"),
    (lambda s: _chat(chat_template_kwargs={"k": s}), "chat_template_kwargs.k"),
    (lambda s: TokenizeRequest(prompt=s), "prompt"),
    (lambda s: TokenizeRequest(messages=[{"role": "user", "content": s}]), "messages.0.content"),
])
@pytest.mark.parametrize("text", ["\ud800", "ab\udfffc"])
def test_lone_surrogates_are_rejected_anywhere(make, param, text):
    with pytest.raises(ValidationError, match="not valid Unicode") as e:
        make(text)
    assert e.value.errors()[0]["ctx"]["param"] == param
    make("caf\u00e9 \U0001f600")  # valid non-ASCII text, including an astral character, is fine


def test_surrogate_in_a_key_is_rejected_and_reported_printably():
    with pytest.raises(ValidationError, match="not valid Unicode") as e:
        CompletionRequest(prompt="a", logit_bias={"\ud800": 1})
    json.dumps(e.value.errors()[0]["ctx"]["param"]).encode("utf-8")  # no lone surrogate left in it


def test_chat_roles_and_developer_is_system():
    for role in ("system", "user", "assistant", "tool"):
        assert ChatCompletionRequest(messages=[{"role": role, "content": "x"}]).messages[0].role == role
    assert ChatCompletionRequest(messages=[{"role": "developer", "content": "x"}]).messages[0].role == "system"
    enum = ChatCompletionRequest.model_json_schema()["$defs"]["ChatMessageParam"]["properties"]["role"]["enum"]
    assert set(enum) == set(ALLOWED_ROLES) | {"developer"}


def test_out_of_vocabulary_ids_are_400_before_any_decode(serving):
    for kw, param in [({"stop_token_ids": [2**63]}, "stop_token_ids"), ({"allowed_token_ids": [384]},
                      "allowed_token_ids"), ({"logit_bias": {str(2**64): 1}}, "logit_bias"),
                      ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"\u0665": 1}}, "logit_bias")]:
        with pytest.raises(OpenAIError) as e:
            serving.sampling_params(_chat(**kw), max_tokens=4, logprobs=None, prompt_logprobs=None)
        assert e.value.status == 400 and e.value.param == param, kw
    serving.check_token_ids([0, 383])
    with pytest.raises(OpenAIError, match="out of vocabulary"):
        serving.check_token_ids([5, 2**63])


def test_error_bodies_never_carry_a_lone_surrogate():
    err = OpenAIError("The model `\ud800` does not exist.", 404, param="a\udfff")
    json.dumps(err.to_body(), ensure_ascii=False).encode("utf-8")
    assert err.to_response().status_code == 404


def test_chat_logprobs_format():
    entries = [{7: Logprob(-0.1, 1, "a"), 8: Logprob(-2.0, 2, "b"), 9: Logprob(-3.0, 3, "c")},
               {5: Logprob(float("-inf"), 9, "é"), 7: Logprob(-0.01, 1, "a")}]
    lp = chat_logprobs([7, 5], entries, top_n=2, tokenizer=None).model_dump()["content"]
    assert lp[0]["token"] == "a" and lp[0]["logprob"] == -0.1 and lp[0]["bytes"] == [97]
    assert [t["token"] for t in lp[0]["top_logprobs"]] == ["a", "b"]
    assert lp[1]["logprob"] == -9999.0 and lp[1]["bytes"] == list("é".encode())  # -inf is not JSON
    assert [t["token"] for t in lp[1]["top_logprobs"]] == ["a"]  # the sampled token ranks 9th
    json.dumps(lp, allow_nan=False)


def test_completion_logprobs_format_with_echoed_prompt():
    entries = [None, {4: Logprob(-1.0, 3, "lo"), 6: Logprob(-0.5, 1, "p")},
               {7: Logprob(-0.2, 1, "!"), 8: Logprob(-0.9, 2, "?")}]
    lp = completion_logprobs_with_end([3, 4, 7], entries, top_n=1, tokenizer=_Tok(), initial_offset=0)[0].model_dump()
    assert lp["tokens"] == ["<3>", "lo", "!"] and lp["text_offset"] == [0, 3, 5]
    assert lp["token_logprobs"] == [None, -1.0, -0.2]
    assert lp["top_logprobs"] == [None, {"p": -0.5, "lo": -1.0}, {"!": -0.2}]  # top-1 plus the sampled token


def test_completion_logprobs_special_tokens_absent_from_the_text_take_no_room():
    # A BOS the tokenizer added (id 3, "<3>") is not in the echoed text "lo!": it gets offset 0
    # and the first real token does too. Where the text shows it (a prompt of token ids,
    # decoded with its specials), it counts as before. An EOS at the end likewise.
    entries = [None, {4: Logprob(-1.0, 1, "lo")}, {7: Logprob(-0.2, 1, "!")}, {9: Logprob(-0.1, 1, "<9>")}]
    lp, end = completion_logprobs_with_end([3, 4, 7, 9], entries, 1, _Tok(), text="lo!", special_ids={3, 9})
    assert lp.tokens == ["<3>", "lo", "!", "<9>"] and lp.text_offset == [0, 0, 2, 3] and end == 3
    lp, end = completion_logprobs_with_end([3, 4, 7], entries[:3], 1, _Tok(), text="<3>lo!", special_ids={3})
    assert lp.text_offset == [0, 3, 5] and end == 6
    # a stream chunk: its text starts at the initial offset
    lp, end = completion_logprobs_with_end([7, 9], entries[2:], 1, _Tok(), 5, text="!", special_ids={9})
    assert lp.text_offset == [5, 6] and end == 6
    assert completion_logprobs_with_end([3, 4], entries[:2], 1, _Tok())[0].text_offset == [0, 3]  # lengths only


def test_prompt_logprobs_json_and_usage():
    assert prompt_logprobs_json(None) is None
    assert prompt_logprobs_json([None, {4: Logprob(-1.0, 2, "x")}]) == [
        None, {"4": {"logprob": -1.0, "rank": 2, "decoded_token": "x"}}]
    outs = [RequestOutput("a", "p", [1, 2, 3], [_choice(0, "xy", [5, 6]), _choice(1, "z", [7])], True,
                          num_cached_tokens=2),
            RequestOutput("b", "q", [1], [_choice(0, "", [8])], True)]
    usage = output_usage(outs).model_dump()
    assert usage == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                     "prompt_tokens_details": {"cached_tokens": 2}}


def test_delta_tracker_adds_up_deltas_and_stops_after_finish():
    t = DeltaTracker()
    d = t.delta(_choice(0, "He", [1]))
    assert (d.text, d.token_ids) == ("He", [1])
    assert t.delta(_choice(0, "", [])) is None  # nothing new
    d = t.delta(_choice(0, "", [2]))  # a token whose text is held back
    assert (d.text, d.token_ids) == ("", [2]) and t.texts(0) == ("He", "He")
    d = t.delta(_choice(0, "llo", [3], "stop", "!"))
    assert (d.text, d.token_ids, d.finish_reason, d.stop_reason) == ("llo", [3], "stop", "!")
    assert t.texts(0) == ("He", "Hello") and t.num_tokens(0) == 3
    assert t.delta(_choice(0, "", [], "stop")) is None and t.num_tokens(0) == 3
    assert t.delta(_choice(1, "x", [4], "length")).finish_reason == "length"  # choices are independent
    assert t.total_tokens() == 4 and t.texts(1) == ("", "x")


def test_sse_framing_and_chunk_shape():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n' and SSE_DONE == "data: [DONE]\n\n"
    resp = ChatCompletionStreamResponse(id="c", created=1, model="m", choices=[
        ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
    data = chunk_json(resp)
    assert "usage" not in data and data["object"] == "chat.completion.chunk"
    assert data["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None, "stop_reason": None}
    resp.choices[0].delta = DeltaMessage()
    assert chunk_json(resp)["choices"][0]["delta"] == {}


def test_merge_async_iterators_interleaves_and_closes_all_on_early_exit():
    closed = []

    async def gen(name, n, delay):
        try:
            for i in range(n):
                await asyncio.sleep(delay)
                yield f"{name}{i}"
        finally:
            closed.append(name)

    async def main():
        items = [x async for x in merge_async_iterators([gen("a", 3, 0.001), gen("b", 2, 0.0015)])]
        assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
        closed.clear()
        merged = merge_async_iterators([gen("a", 100, 0.001), gen("b", 100, 0.001)])
        await anext(merged)
        await merged.aclose()
        assert sorted(closed) == ["a", "b"]

    asyncio.run(main())


def test_peek_all_surfaces_errors_before_streaming_and_closes_the_rest():
    closed = []

    async def good():
        try:
            yield 1
            yield 2
        finally:
            closed.append("good")

    async def bad():
        raise OpenAIError("nope")
        yield  # pragma: no cover

    async def main():
        streams = await peek_all([good(), good()])
        for s in streams:
            assert [x async for x in s] == [1, 2]
        closed.clear()
        with pytest.raises(OpenAIError, match="nope"):
            await peek_all([good(), bad()])
        assert closed == ["good"]

    asyncio.run(main())


class _Tok:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def _choice(index, text, ids, finish=None, stop=None) -> CompletionOutput:
    return CompletionOutput(index, text, ids, None, None, finish, stop)
