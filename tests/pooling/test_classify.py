"""Sequence classifiers: tiny random BertForSequenceClassification and Qwen3ForSequenceClassification
against transformers (softmax of the logits), offline (`LLM.classify`) and served (`/classify`,
labels from id2label)."""

from __future__ import annotations

import httpx
import pytest
import torch

from pagedllm import LLM
from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny
from tests.utils import build_tokenizer, tiny_config

PROMPTS = [[5, 17, 33, 2, 90], [44, 3], list(range(10, 70)), [7]]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _bert_classifier(path: str) -> str:
    from transformers import BertConfig, BertForSequenceClassification

    tok = build_tokenizer(path)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=512, num_labels=3, id2label=LABELS,
                     label2id={v: k for k, v in LABELS.items()})
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).eval().save_pretrained(path)
    return path


def _qwen3_classifier(path: str) -> str:
    from transformers import Qwen3ForSequenceClassification

    tok = build_tokenizer(path)
    cfg = tiny_config("qwen3", len(tok), num_labels=2)
    cfg.architectures = ["Qwen3ForSequenceClassification"]
    torch.manual_seed(0)
    Qwen3ForSequenceClassification(cfg).eval().save_pretrained(path)
    return path


@pytest.mark.parametrize("build", [_bert_classifier, _qwen3_classifier])
def test_classify_equals_transformers(tmp_path, build):
    from transformers import AutoModelForSequenceClassification

    path = build(str(tmp_path))
    llm = LLM(path, dtype="float32")  # runner auto: a classifier pools
    assert llm.llm_engine.config.model_config.runner == "pooling"
    ref_model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    for ids, out in zip(PROMPTS, llm.classify(PROMPTS, use_tqdm=False)):
        with torch.inference_mode():
            ref = ref_model(torch.tensor([ids])).logits[0].softmax(-1)
        assert torch.allclose(torch.tensor(out.outputs.probs), ref, atol=1e-5)
        assert out.outputs.num_classes == ref_model.config.num_labels


def test_classify_route(tmp_path, tmp_path_factory):
    path = _bert_classifier(str(tmp_path))
    expected = [o.outputs.probs for o in LLM(path, dtype="float32").classify(PROMPTS[:2], use_tqdm=False)]
    serving = serve_tiny(path, tmp_path_factory)
    url = next(serving)
    try:
        r = httpx.post(f"{url}/classify", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL, "input": PROMPTS[:2]})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["num_classes"] for d in data] == [3, 3]
        for d, probs in zip(data, expected):
            assert torch.allclose(torch.tensor(d["probs"]), torch.tensor(probs), atol=1e-6)
            assert d["label"] == LABELS[max(range(3), key=probs.__getitem__)]
    finally:
        next(serving, None)


WORDS = "where do cats sleep on the sofa stock prices fell today dogs bark at night a an is".split()


def _cross_encoder(path: str) -> str:
    """A tiny BERT cross-encoder (one label) with a WordPiece tokenizer that encodes text pairs
    as [CLS] a [SEP] b [SEP] with token type ids."""
    import os

    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    os.makedirs(path, exist_ok=True)
    vocab = os.path.join(path, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "?", ".", *WORDS]) + "\n")
    tok = BertTokenizerFast(vocab_file=vocab)
    tok.save_pretrained(path)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=512, num_labels=1)
    torch.manual_seed(1)
    BertForSequenceClassification(cfg).eval().save_pretrained(path)
    return path


def test_cross_encoder_scores_pairs_with_token_types(tmp_path, tmp_path_factory):
    from sentence_transformers import CrossEncoder

    path = _cross_encoder(str(tmp_path))
    query, docs = "where do cats sleep?", ["cats sleep on the sofa.", "stock prices fell today.", "dogs bark at night."]
    ref = CrossEncoder(path, device="cpu").predict([(query, d) for d in docs])  # sigmoid of the one logit
    outs = LLM(path, dtype="float32").score(query, docs, use_tqdm=False)
    assert torch.allclose(torch.tensor([o.outputs.score for o in outs]), torch.tensor(ref), atol=1e-5)
    serving = serve_tiny(path, tmp_path_factory)
    url = next(serving)
    try:
        r = httpx.post(f"{url}/v1/rerank", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL, "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -float(ref[i]))
        assert abs(results[0]["relevance_score"] - float(max(ref))) < 1e-5
    finally:
        next(serving, None)


def test_convert_picks_what_a_pooling_model_returns(tmp_path, tiny_llama):
    from transformers import BertModel

    from pagedllm.engine.arg_utils import EngineArgs

    path = _bert_classifier(str(tmp_path))
    embedder = LLM(path, dtype="float32", convert="embed")  # the classifier's encoder, head skipped
    with pytest.raises(ValueError, match="classify needs a sequence-classification model"):
        embedder.classify(PROMPTS[:1], use_tqdm=False)
    (out,) = embedder.embed(PROMPTS[:1], use_tqdm=False)
    with torch.inference_mode():
        cls = BertModel.from_pretrained(path).eval()(torch.tensor(PROMPTS[:1])).last_hidden_state[0, 0]
    assert torch.allclose(torch.tensor(out.outputs.embedding), cls / cls.norm(), atol=1e-5)
    assert EngineArgs(model=tiny_llama, convert="embed").create_engine_config().model_config.runner == "pooling"
    with pytest.raises(ValueError, match="--convert classify needs a sequence-classification checkpoint"):
        EngineArgs(model=tiny_llama, convert="classify").create_engine_config()
