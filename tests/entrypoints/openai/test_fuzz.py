"""Schemathesis over the served OpenAPI document, against `pagedllm serve` on the tiny model:
every operation, valid and invalid bodies, a bounded number of examples each. No input may
get a 5xx, and every status must be one the document states. Then the hostile inputs that
once did get a 500 (or a silent 200), each against the real engine."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 64
# Per operation and generation mode (valid / invalid data).
MAX_EXAMPLES = 5  # per operation and mode; derandomized, so every run sends the same cases
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama, tmp_path_factory):
    # LoRA on, with the runtime adapter routes, so that they are documented and fuzzed too.
    yield from serve_tiny(tiny_llama, tmp_path_factory,
                          extra_args=("--max-model-len", str(MAX_MODEL_LEN), "--enable-lora"),
                          env={"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server}/openapi.json", headers=AUTH, timeout=30)


def _bounded(body):
    """Keep generated requests cheap (one engine on 2 cores): few samples, few tokens, few
    prompts. Only the amounts change; every odd type or value still reaches the server."""
    if not isinstance(body, dict):
        return body
    caps = (("n", 2), ("best_of", 2), ("max_tokens", 4), ("max_completion_tokens", 4), ("max_output_tokens", 4))
    for key, cap in caps:
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > cap:
            body[key] = cap
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4:
        body["prompt"] = body["prompt"][:4]
    return body


# What schemathesis rarely or never sends (it draws valid Unicode only): appended to a string,
# or in place of a number, anywhere in a body. (NaN / Infinity cannot go through its JSON
# serializer; test_hostile_input_is_400_on_the_real_engine and test_api_server.py send them.)
_SURROGATE = "\ud800"
_BAD_NUMBERS = (-1, 2**63, 2**64 + 1)


def _leaves(value, path=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    elif isinstance(value, (str, int, float)) and not isinstance(value, bool) and path:
        yield path


def _poison(body, data) -> bool:
    """Half the bodies get one hostile leaf: a lone surrogate or an out-of-range integer
    (a token id, say), as a hand-written client could send. Says whether it did."""
    leaves = list(_leaves(body))
    if not leaves or not data.draw(st.booleans(), label="poison"):
        return False
    *parents, last = data.draw(st.sampled_from(leaves), label="leaf")
    holder = body
    for key in parents:
        holder = holder[key]
    if isinstance(holder[last], str):
        holder[last] += _SURROGATE
    else:
        holder[last] = data.draw(st.sampled_from(_BAD_NUMBERS), label="number")
    return True


def _send_poisoned(url: str, case) -> None:
    """The two checks that matter for a hostile body: no 5xx, and a documented status."""
    body = json.dumps(case.body)  # ASCII, with the surrogate as a \\ud800 escape
    r = httpx.request(case.method, f"{url}{case.path}", content=body, timeout=60,
                      headers={**AUTH, "Content-Type": "application/json"})
    documented = case.operation.definition.raw["responses"]
    assert r.status_code < 500 and str(r.status_code) in documented, (case.method, case.path, body, r.text)


def test_openapi_fuzz(fuzz_server, fuzz_schema):
    """Hypothesis driven directly (schemathesis' pytest plugin is not used: its lazy
    from_fixture loader fails on pytest 9). Every operation, valid and invalid data; all
    failures are collected, then reported together. Besides no 5xx: every status, media type
    and JSON body is one the document states, and invalid data is always a 4xx. Half the
    bodies also carry one value schemathesis itself never generates (_poison)."""
    failures = []
    operations = [result.ok() for result in fuzz_schema.get_all_operations()]
    assert len(operations) >= 8, [op.label for op in operations]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            # No shrinking: each step is a server round trip, and a failure's curl line is enough.
            @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), phases=[p for p in Phase if p is not Phase.shrink])
            @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
            def run(case, data):
                case.body = _bounded(case.body)
                if _poison(case.body, data):  # sent by hand: schemathesis re-validates (and chokes on) a lone surrogate
                    _send_poisoned(fuzz_server, case)
                else:
                    case.call_and_validate(headers=AUTH, timeout=60, checks=CHECKS)

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid: no body, only string path parameters
                assert mode is GenerationMode.NEGATIVE and not list(operation.body), operation.label
            except (Exception, FailureGroup) as e:  # a failed check, after shrinking: keep going, report all
                failures.append(f"{operation.label} ({mode.value}): {e}")
    assert not failures, "\n\n".join(failures)
    assert httpx.get(f"{fuzz_server}/health").status_code == 200  # the engine took it all and lives


BIG = 2**63


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [BIG]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [-3]]}, "prompt"),
    ("/v1/completions", {"prompt": [5, 100_000]}, "prompt"),
    ("/v1/completions", {"stop_token_ids": [BIG]}, "stop_token_ids"),
    ("/v1/completions", {"logit_bias": {str(BIG): 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"bad_words": ["\ud800"]}, "bad_words.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/v1/chat/completions", {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ("/detokenize", {"tokens": ["5"]}, "tokens.0"),
    ("/v1/completions", {"temperature": float("nan")}, "temperature"),
    ("/v1/completions", {"logit_bias": {"5": float("nan")}}, "logit_bias.5"),
])
def test_hostile_input_is_400_on_the_real_engine(fuzz_server, path, body, param):
    """The fake-engine suite (test_api_server.py) has the full list; these once were 500s
    (or a 200 of <pad> tokens for a NaN temperature) with the real engine behind the server."""
    base = {"model": MODEL, "max_tokens": 2}
    base |= {"messages": [{"role": "user", "content": "Hi"}]} if path == "/v1/chat/completions" else (
        {"prompt": "Hello"} if path == "/v1/completions" else {})
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(f"{fuzz_server}{path}", content=json.dumps({**base, **body}), headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and error["param"] == param, error
    assert httpx.get(f"{fuzz_server}/health").status_code == 200
