"""Pooling models offline: the default embedding model (all-MiniLM-L6-v2) against
sentence-transformers, tiny random BERT and decoder checkpoints against transformers, batched
and alone, and the clear errors (wrong runner, too long, dimensions without matryoshka)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.pooling_params import PoolingParams
from tests.utils import build_tokenizer, make_tiny_model

SENTENCES = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "A", "What is the capital of France?",
    "Embeddings map text to vectors so that similar meanings land close together, which search uses.",
    "¿Dónde está la biblioteca?", "3.14159 is pi", "def f(x): return x * 2", "🙂 emojis too", "ok",
] * 5  # 50 sentences, ten shapes


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def minilm():
    return LLM(runner="pooling", dtype="float32")


def test_default_embedding_model_equals_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    from pagedllm.transformers_utils.default_model import resolve_default_pooling_model

    sentences = [f"{s} ({i})" for i, s in enumerate(SENTENCES)]
    ref = SentenceTransformer(resolve_default_pooling_model(), device="cpu").encode(sentences)
    batched = minilm.embed(sentences, use_tqdm=False)
    alone = [minilm.embed(s, use_tqdm=False)[0] for s in sentences[:10]]
    assert all(len(o.outputs.embedding) == 384 for o in batched)
    assert min(_cos(o.outputs.embedding, r) for o, r in zip(batched, ref)) >= 0.99999
    assert min(_cos(o.outputs.embedding, r) for o, r in zip(alone, ref)) >= 0.99999
    assert abs(np.linalg.norm(batched[0].outputs.embedding) - 1) < 1e-5  # the Normalize module


def test_errors_say_what_to_do(minilm, tiny_llama):
    with pytest.raises(ValueError, match="--runner generate"):
        minilm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum is 256"):
        minilm.embed(" ".join(["word"] * 300), use_tqdm=False)
    long = minilm.embed(" ".join(["word"] * 300), PoolingParams(truncate_prompt_tokens=256), use_tqdm=False)
    assert len(long[0].prompt_token_ids) == 256
    with pytest.raises(ValueError, match="does not support matryoshka"):
        minilm.embed("hi", PoolingParams(dimensions=8), use_tqdm=False)
    generator = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="--runner pooling"):
        generator.embed("hi", use_tqdm=False)


def _tiny_bert(path: str, **overrides) -> str:
    from transformers import BertConfig, BertModel

    tok = build_tokenizer(path)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128, **overrides)
    torch.manual_seed(0)
    BertModel(cfg).eval().save_pretrained(path)
    return path


PROMPTS = [[5, 17, 33, 2, 90], [44, 3], list(range(10, 70)), [7]]


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_tiny_bert_equals_transformers(tmp_path, pooling_type):
    from transformers import BertModel

    path = _tiny_bert(str(tmp_path), is_matryoshka=True)
    llm = LLM(path, runner="pooling", dtype="float32", pooler_config={"pooling_type": pooling_type, "normalize": False})
    ref_model = BertModel.from_pretrained(path).eval()
    outs = llm.encode(PROMPTS, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            hidden = ref_model(torch.tensor([ids])).last_hidden_state[0]
        ref = hidden.mean(0) if pooling_type == "MEAN" else hidden[0]
        assert torch.allclose(torch.tensor(out.outputs.data), ref, atol=1e-5)
    # Matryoshka: the first 16 values, then normalized.
    (short,) = llm.embed(PROMPTS[0], PoolingParams(dimensions=16, normalize=True), use_tqdm=False)
    full = torch.tensor(outs[0].outputs.data[:16])
    assert torch.allclose(torch.tensor(short.outputs.embedding), full / full.norm(), atol=1e-6)


@pytest.mark.parametrize("arch, pooling_type", [("qwen3", "LAST"), ("gemma3", "MEAN"), ("llama", "LAST")])
def test_decoder_models_embed(tmp_path, arch, pooling_type):
    from transformers import AutoModel

    path = make_tiny_model(str(tmp_path), arch)
    llm = LLM(path, runner="pooling", dtype="float32", pooler_config={"pooling_type": pooling_type})
    ref_model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            hidden = ref_model(torch.tensor([ids])).last_hidden_state[0]
        ref = hidden[-1] if pooling_type == "LAST" else hidden.mean(0)
        assert _cos(out.outputs.embedding, ref) >= 0.99999
        assert abs(np.linalg.norm(out.outputs.embedding) - 1) < 1e-5


def test_score_is_the_cosine_of_the_embeddings(minilm):
    from sentence_transformers import SentenceTransformer, util

    from pagedllm.transformers_utils.default_model import resolve_default_pooling_model

    query, docs = "Where do cats sleep?", ["Cats sleep on the sofa.", "Stock prices fell today.", "Dogs bark."]
    outs = minilm.score(query, docs, use_tqdm=False)
    st = SentenceTransformer(resolve_default_pooling_model(), device="cpu")
    ref = util.cos_sim(st.encode([query]), st.encode(docs))[0]
    assert [round(o.outputs.score, 4) for o in outs] == [round(float(r), 4) for r in ref]
    assert max(range(3), key=lambda i: outs[i].outputs.score) == 0
    pairwise = minilm.score(docs, docs, use_tqdm=False)  # each text with itself
    assert all(abs(o.outputs.score - 1) < 1e-5 for o in pairwise)
    with pytest.raises(ValueError, match="give one text_1, or as many as text_2"):
        minilm.score(docs[:2], docs, use_tqdm=False)


def test_pooling_across_processes_and_engine_cores(minilm):
    """PoolingParams and the vectors cross to worker processes (msgspec), over two engine cores."""
    expected = [o.outputs.embedding for o in minilm.embed(SENTENCES[:10], use_tqdm=False)]
    llm = LLM(runner="pooling", dtype="float32", data_parallel_size=2, distributed_executor_backend="mp")
    try:
        got = [o.outputs.embedding for o in llm.embed(SENTENCES[:10], use_tqdm=False)]
        assert all(_cos(a, b) >= 0.99999 for a, b in zip(got, expected))
        assert all(s["prefix_cache_queries"] == 0 for s in llm.llm_engine.get_engine_stats())  # caching is off
        assert llm.llm_engine.balancer.num_unfinished == [0, 0]
    finally:
        for core in llm.llm_engine.engine_cores:
            core.shutdown()


def test_pooling_requests_queue_by_priority_and_abort(tmp_path):
    """Pooling requests go through the scheduler like any: by priority, and an abort frees them."""
    path = make_tiny_model(str(tmp_path), "qwen3")
    llm = LLM(path, runner="pooling", dtype="float32", max_num_seqs=1, scheduling_policy="priority")
    engine = llm.llm_engine
    for req_id, priority in (("late", 5), ("urgent", -1), ("gone", 0)):
        engine.add_pooling_request(req_id, [5, 6, 7], PoolingParams(), priority=priority)
    engine.abort_request("gone")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["urgent", "late"]
    kv = engine.engine_core.scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.block_pool.num_blocks


def test_encode_gives_the_raw_pooled_state(minilm):
    (raw,) = minilm.encode("Hello world", use_tqdm=False)
    (emb,) = minilm.embed("Hello world", use_tqdm=False)
    norm = np.linalg.norm(raw.outputs.data)
    assert abs(norm - 1) > 1e-3 and np.allclose(np.asarray(raw.outputs.data) / norm, emb.outputs.embedding, atol=1e-6)


def test_pooling_with_tensor_and_pipeline_parallelism(tmp_path):
    """BERT split over two tensor-parallel ranks, a decoder embedder over two pipeline stages:
    the same vectors as one rank. BERT is not split into stages (a clear error)."""
    from pagedllm.engine.arg_utils import EngineArgs

    expected = [o.outputs.embedding for o in LLM(runner="pooling", dtype="float32").embed(SENTENCES[:4],
                                                                                          use_tqdm=False)]
    tp = LLM(runner="pooling", dtype="float32", tensor_parallel_size=2)
    try:
        got = [o.outputs.embedding for o in tp.embed(SENTENCES[:4], use_tqdm=False)]
    finally:
        tp.llm_engine.engine_core.shutdown()
    assert all(_cos(a, b) >= 0.99999 for a, b in zip(got, expected))
    path = make_tiny_model(str(tmp_path), "qwen3")
    expected = [o.outputs.embedding for o in LLM(path, runner="pooling", dtype="float32").embed(PROMPTS,
                                                                                                use_tqdm=False)]
    pp = LLM(path, runner="pooling", dtype="float32", pipeline_parallel_size=2)
    try:
        got = [o.outputs.embedding for o in pp.embed(PROMPTS, use_tqdm=False)]
    finally:
        pp.llm_engine.engine_core.shutdown()
    assert all(_cos(a, b) >= 0.99999 for a, b in zip(got, expected))
    with pytest.raises(ValueError, match="use tensor_parallel_size, not pipeline_parallel_size"):
        EngineArgs(runner="pooling", pipeline_parallel_size=2).create_engine_config()
