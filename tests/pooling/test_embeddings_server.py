"""`pagedllm serve --runner pooling` (the default embedding model) as a real process: the openai
SDK's embeddings.create (float and base64, strings and token ids), LangChain's OpenAIEmbeddings,
and the 400s for what a pooling server cannot do."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from pagedllm.transformers_utils.default_model import resolve_default_pooling_model
from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(resolve_default_pooling_model(), tmp_path_factory, extra_args=("--runner", "pooling"))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline():
    from pagedllm import LLM

    llm = LLM(runner="pooling", dtype="float32")
    return [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]


def _close(a, b) -> bool:
    return np.allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_openai_sdk_floats_base64_and_token_ids(client, offline):
    floats = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == MODEL
    assert all(_close(d.embedding, ref) for d, ref in zip(floats.data, offline))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    # Asked for explicitly, base64 arrives as the string: little-endian float32.
    packed = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64")
    assert _close(np.frombuffer(base64.b64decode(packed.data[0].embedding), dtype="<f4"), offline[0])
    by_ids = client.embeddings.create(model=MODEL, input=[[101, 7592, 2088, 102], [101, 102]])
    assert len(by_ids.data) == 2 and len(by_ids.data[0].embedding) == 384


def test_langchain_openai_embeddings(server, offline):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model=MODEL, base_url=f"{server}/v1", api_key=API_KEY, check_embedding_ctx_length=False)
    docs = emb.embed_documents(TEXTS)
    assert all(_close(d, ref) for d, ref in zip(docs, offline))
    assert _close(emb.embed_query(TEXTS[1]), offline[1])


def test_pooled_requests_count_in_metrics(server, client):
    def prompt_tokens() -> float:
        text = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        line = next(ln for ln in text.splitlines() if ln.startswith("pagedllm:prompt_tokens_total"))
        return float(line.rsplit(" ", 1)[1])

    before = prompt_tokens()
    used = client.embeddings.create(model=MODEL, input=TEXTS).usage.prompt_tokens
    assert prompt_tokens() == before + used


def test_what_a_pooling_server_refuses(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server}/v1/embeddings", headers=headers, json={"model": MODEL, "input": "word " * 400})
    assert r.status_code == 400 and "maximum context length is 256" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/embeddings", headers=headers,
                   json={"model": MODEL, "input": "word " * 400, "truncate_prompt_tokens": 256})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model=MODEL, input="hi", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="start a generation server"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="start a generation server"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_score_and_rerank_routes(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    query, docs = "Where do cats sleep?", ["Stock prices fell today.", "Cats sleep on the sofa.", "Dogs bark."]
    scores = {}
    for path in ("/score", "/v1/score"):
        r = httpx.post(f"{server}{path}", headers=headers, json={"model": MODEL, "text_1": query, "text_2": docs})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
        scores[path] = [d["score"] for d in body["data"]]
    assert np.allclose(scores["/score"], scores["/v1/score"], atol=1e-6)  # batches differ: float rounding
    assert max(range(3), key=scores["/score"].__getitem__) == 1
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(f"{server}{path}", headers=headers,
                       json={"model": MODEL, "query": query, "documents": docs, "top_n": 2})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -scores["/score"][i])[:2]
        assert results[0]["document"] == {"text": docs[1]} and r.json()["usage"]["total_tokens"] > 0
        assert abs(results[0]["relevance_score"] - scores["/score"][1]) < 1e-6
    r = httpx.post(f"{server}/rerank", headers=headers,
                   json={"query": query, "documents": [{"text": d} for d in docs], "return_documents": False})
    assert len(r.json()["results"]) == 3 and "document" not in r.json()["results"][0]
    r = httpx.post(f"{server}/score", headers=headers, json={"text_1": docs[:2], "text_2": docs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"


def test_pooling_route_gives_the_raw_pooled_states(server, offline):
    r = httpx.post(f"{server}/pooling", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "input": TEXTS[:2]})
    assert r.status_code == 200, r.text
    data = [d["data"] for d in r.json()["data"]]
    assert r.json()["data"][0]["object"] == "pooling"
    # Not normalized: the same direction as the embedding, another length.
    for raw, emb in zip(data, offline):
        raw = np.asarray(raw)
        assert abs(np.linalg.norm(raw) - 1) > 1e-3 and _close(raw / np.linalg.norm(raw), emb)
