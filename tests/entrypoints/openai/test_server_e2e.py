"""`pagedllm serve` as a real process on a tiny model, driven by the official openai SDK:
chat and completions, streaming == non-streaming, n, logprobs, stop, usage, seeds, errors,
client disconnects freeing KV blocks, and 32 concurrent requests."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.serve_utils import API_KEY, AUTH, MODEL, metrics_once_idle, read_metrics, serve_tiny

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, my name is"}]
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from serve_tiny(tiny_llama, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def test_models_and_tokenize(client, server):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.owned_by == "pagedllm" and card.model_extra["max_model_len"] == 256
    tok = httpx.post(f"{server}/tokenize", json={"prompt": "Hello"}, headers=AUTH).json()
    assert httpx.post(f"{server}/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH).json()["prompt"] == "Hello"


def test_chat_stream_equals_non_stream_and_usage(client, server):
    full = client.chat.completions.create(model=MODEL, messages=MSGS, **GREEDY)
    (choice,) = full.choices
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and choice.message.content
    n_prompt = httpx.post(f"{server}/tokenize", json={"messages": MSGS}, headers=AUTH).json()["count"]
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        n_prompt, 12, n_prompt + 12)

    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completions_stream_equals_non_stream_with_logprobs(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", logprobs=2, **GREEDY)
    full = client.completions.create(**kw).choices[0]
    lp = full.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # top-2 + sampled; equal strings merge
    streamed = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == full.text
    assert [t for c in streamed for t in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert content[0].logprob == content[0].top_logprobs[0].logprob  # greedy picks the top token


def test_n_and_prompt_lists(client):
    r = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [5, 6, 7]], n=2, max_tokens=5, temperature=1.0,
                                  seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 20
    chat = client.chat.completions.create(model=MODEL, messages=MSGS, n=3, max_tokens=4, temperature=1.0)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_n_above_max_n_is_400(client):
    with pytest.raises(openai.BadRequestError, match="max_n") as e:
        client.completions.create(model=MODEL, prompt="Hello", n=129, max_tokens=1, temperature=1.0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="max_n"):
        client.chat.completions.create(model=MODEL, messages=MSGS, n=200, max_tokens=1, temperature=1.0)


def test_seed_reproducibility(client):
    def run(seed):
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert run(123) == run(123)
    assert run(123) != run(456)


def test_stop_string(client):
    text = client.completions.create(model=MODEL, prompt="Hello", **GREEDY).choices[0].text
    # two plain characters from the middle (a replacement character could match a partial token)
    stops = [text[i:i + 2] for i in range(3, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isprintable()]
    assert stops, text
    stop = stops[0]
    r = client.completions.create(model=MODEL, prompt="Hello", stop=[stop], **GREEDY).choices[0]
    assert r.finish_reason == "stop" and r.text == text[: text.index(stop)]
    assert r.model_extra["stop_reason"] == stop


def test_errors(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1000)
    assert "maximum context length is 256" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, temperature=-1)
    assert e.value.body["param"] == "temperature" and e.value.body["code"] == 400
    with pytest.raises(openai.BadRequestError, match="suffix is not supported"):
        client.completions.create(model=MODEL, prompt="x", suffix="y")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MSGS)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}",
                                                             "x-request-id": "req-42"},
                   json={"model": MODEL, "messages": "nope"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "req-42"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and "messages" in r.json()["error"]["message"]
    assert httpx.get(f"{server}/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 404
    assert httpx.get(f"{server}/health").status_code == 200  # no key needed


def test_disconnect_mid_stream_frees_kv_blocks(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 250, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        mid = read_metrics(server)
        assert mid["pagedllm:num_requests_running"] == 1 and mid["pagedllm:kv_cache_usage_perc"] > 0
    after = metrics_once_idle(server)
    assert after['pagedllm:request_success_total{finished_reason="abort",model_name="tiny"}'] >= 1


def test_32_concurrent_requests(server):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
        async with aclient:
            return await asyncio.gather(*[
                aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Hi {i}"}],
                                                max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
                for i in range(32)])

    results = asyncio.run(run())
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8 for r in results)
    assert len({r.id for r in results}) == 32
    m = read_metrics(server)
    assert m["pagedllm:generation_tokens_total"] >= 256 and m["pagedllm:time_to_first_token_seconds_count"] >= 32


def test_bench_serve_against_real_server(server):
    import argparse

    from pagedllm.entrypoints.cli.bench_serve import run_bench_serve

    args = argparse.Namespace(
        base_url=server, model=None, api_key=API_KEY, num_prompts=6, input_len=8, random_prefix_len=40, output_len=5,
        request_rate=float("inf"), max_concurrency=2, seed=0, output_json=None,
    )
    hits = read_metrics(server).get("pagedllm:prefix_cache_hits_total", 0.0)
    m = run_bench_serve(args)
    assert m["completed"] == 6 and m["failed"] == 0
    assert m["total_output_tokens"] == 6 * 5
    # The shared 40-token prefix is two full 16-token blocks: the four requests after the first
    # two (which run together, before any block is cached) find them in the prefix cache.
    assert read_metrics(server)["pagedllm:prefix_cache_hits_total"] - hits >= 4 * 32
    assert 0 < m["mean_ttft_ms"] <= m["mean_e2el_ms"]
    assert m["mean_tpot_ms"] > 0 and m["output_throughput"] > 0


def test_engine_core_death_gives_503_and_unhealthy(tiny_llama, tmp_path_factory):
    """Kill the engine-core process of a live server: the in-flight stream ends with an
    error, new requests get 503 and /health turns 503; nothing hangs."""
    import psutil

    procs: list = []
    gen = serve_tiny(tiny_llama, tmp_path_factory, procs)
    url = next(gen)
    try:
        (core,) = [c for c in psutil.Process(procs[0].pid).children() if "core_proc" in " ".join(c.cmdline())]
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            core.kill()
            rest = [line for line in lines if line]  # must terminate, with an error event before [DONE]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
        deadline = time.time() + 10
        while httpx.get(f"{url}/health", timeout=5).status_code != 503:
            assert time.time() < deadline, "/health never turned 503"
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers=headers, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["message"]
    finally:
        gen.close()


def test_requests_cannot_read_files(server):
    """chat_template naming a file: 401 without the key, 400 with it, never the file's text."""
    for path in ("/proc/self/cmdline", "/proc/self/environ", "/etc/passwd"):
        body = {"messages": MSGS, "chat_template": path, "return_token_strs": True}
        assert httpx.post(f"{server}/tokenize", json=body).status_code == 401
        r = httpx.post(f"{server}/tokenize", json=body, headers=AUTH)
        assert r.status_code == 400 and API_KEY not in r.text and "root:" not in r.text
        r = httpx.post(f"{server}/v1/chat/completions", json={**body, "model": MODEL, "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 400 and API_KEY not in r.text
