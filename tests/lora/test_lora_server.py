"""`pagedllm serve --enable-lora --lora-modules ...` as a real process on the tiny llama, with PEFT
adapters, driven by the openai SDK: the adapters listed as models, greedy completions under an
adapter equal to transformers + PeftModel (and not the base model's), base and two adapters
concurrently, loading and unloading at run time, a bad adapter refused with the server still
healthy, the LoRA gauges on /metrics, and a bad `--lora-modules` adapter stopping the start."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import openai
import pytest

from tests.entrypoints.openai.serve_utils import API_KEY, AUTH, MODEL, serve_tiny
from tests.lora.test_lora_peft import make_adapter, peft_greedy, pytestmark  # noqa: F401  (needs peft)
from tests.utils import assert_greedy_match, free_port

PROMPTS = ["The quick brown fox", "Hello, my name is", "Paged attention stores keys"]
MAX_TOKENS = 8
GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, extra_body={"ignore_eos": True})
ADAPTERS = {  # name → (rank, alpha, targets)
    "sql": (8, 16, ["q_proj", "v_proj", "o_proj"]),
    "poem": (16, 8, ["gate_proj", "up_proj", "down_proj"]),
    "late": (4, 8, ["k_proj", "down_proj"]),  # loaded at run time
    "big": (32, 32, ["q_proj"]),  # above --max-lora-rank: refused
}


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_server")
    return {name: make_adapter(tiny_llama, str(root / name), rank, alpha, targets, False, seed=20 + i)
            for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory, adapters):
    poem = json.dumps({"name": "poem", "path": adapters["poem"], "base_model_name": MODEL})
    yield from serve_tiny(tiny_llama, tmp_path_factory,
                          extra_args=("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                                      "--lora-modules", f"sql={adapters['sql']}", poem),
                          env={"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny_llama, adapters, prompt_ids) -> dict[str | None, list[dict]]:
    """transformers (+ PeftModel) greedy tokens and logprobs, per adapter (None: the base model)."""
    return {name: peft_greedy(tiny_llama, adapters.get(name), prompt_ids, MAX_TOKENS)
            for name in (None, "sql", "poem", "late")}


def _token_ids(choice, ref: list[int], tokenizer) -> list[int]:
    """The choice's tokens as ids: the completions API gives each token's text; where it is the
    reference token's text it is that token, elsewhere a mismatch (-1)."""
    return [want if tokenizer.decode([want]) == text else -1
            for text, want in zip(choice.logprobs.tokens, ref)] + [-1] * (len(choice.logprobs.tokens) - len(ref))


def _check(outs: list, model: str | None, reference, tokenizer) -> None:
    ref = reference[model]
    assert_greedy_match([_token_ids(o.choices[0], r["tokens"], tokenizer) for o, r in zip(outs, ref)], ref)


def test_models_list_shows_adapters_with_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [MODEL, "sql", "poem"]
    for name in ("sql", "poem"):
        assert cards[name].parent == MODEL and cards[name].root == adapters[name]
    assert client.models.retrieve("sql").root == adapters["sql"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_adapter_completions_equal_peft(client, prompt_ids, reference, tokenizer):
    for model in ("sql", "poem", None):
        outs = [client.completions.create(model=model or MODEL, prompt=ids, **GREEDY) for ids in prompt_ids]
        assert all(o.model == (model or MODEL) for o in outs)
        _check(outs, model, reference, tokenizer)
    # The adapters really change the output (and the server's equals the reference's).
    for model in ("sql", "poem"):
        assert any(r["tokens"] != b["tokens"] for r, b in zip(reference[model], reference[None]))
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.model == "sql" and chat.choices[0].message.content is not None
    response = client.responses.create(model="poem", input="Hi", max_output_tokens=3, store=False)
    assert response.model == "poem" and response.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=1)


def test_base_and_two_adapters_concurrently(server, prompt_ids, reference, tokenizer):
    async def run() -> dict[str | None, list]:
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
        models = [None, "sql", "poem"]
        jobs = [(m, ids) for _ in range(2) for ids in prompt_ids for m in models]
        outs = await asyncio.gather(*[aclient.completions.create(model=m or MODEL, prompt=ids, **GREEDY)
                                      for m, ids in jobs])
        await aclient.close()
        return {m: [o for (mm, _), o in zip(jobs, outs) if mm == m] for m in models}

    for model, outs in asyncio.run(run()).items():
        for half in (outs[:len(PROMPTS)], outs[len(PROMPTS):]):
            _check(half, model, reference, tokenizer)


def test_load_and_unload_at_run_time(client, server, adapters, prompt_ids, reference, tokenizer):
    load = httpx.post(f"{server}/v1/load_lora_adapter", headers=AUTH,
                      json={"lora_name": "late", "lora_path": adapters["late"]})
    assert load.status_code == 200 and load.text == "Success: LoRA adapter 'late' added successfully."
    card = client.models.retrieve("late")
    assert card.parent == MODEL and card.root == adapters["late"]
    outs = [client.completions.create(model="late", prompt=ids, **GREEDY) for ids in prompt_ids]
    _check(outs, "late", reference, tokenizer)
    again = httpx.post(f"{server}/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": "late", "lora_path": adapters["late"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]

    unload = httpx.post(f"{server}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "late"})
    assert unload.status_code == 200 and "removed successfully" in unload.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="Hi", max_tokens=1)
    assert "late" not in [m.id for m in client.models.list().data]
    gone = httpx.post(f"{server}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "late"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == 404


def test_bad_adapter_is_400_and_the_server_stays_healthy(client, server, adapters, tmp_path):
    for path, message in ((adapters["big"], "rank 32 is above --max-lora-rank 16"),
                          (str(tmp_path / "missing"), "not a directory")):
        r = httpx.post(f"{server}/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "bad", "lora_path": path})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert httpx.get(f"{server}/health").status_code == 200
    assert "bad" not in [m.id for m in client.models.list().data]
    assert client.completions.create(model="sql", prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"


def test_metrics_show_lora_gauges(client, server):
    client.completions.create(model="sql", prompt="Hi", max_tokens=2)
    text = httpx.get(f"{server}/metrics", headers=AUTH).text
    info = [line for line in text.splitlines() if line.startswith("pagedllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0], info
    for name in ("sql", "poem"):  # idle now: zero, not the last count
        assert f'pagedllm:lora_requests_running{{lora_name="{name}",model_name="{MODEL}"}} 0.0' in text
        assert f'pagedllm:lora_requests_waiting{{lora_name="{name}",model_name="{MODEL}"}} 0.0' in text


def test_bad_lora_module_fails_the_start(tiny_llama, tmp_path):
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", tiny_llama, "--host", "127.0.0.1",
           "--port", str(free_port()), "--dtype", "float32", "--kv-cache-memory", "16MiB", "--enable-lora",
           "--lora-modules", f"bad={tmp_path / 'missing'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "error: --lora-modules bad: LoRA adapter" in done.stderr, done.stderr[-2000:]
    assert "not a directory" in done.stderr
