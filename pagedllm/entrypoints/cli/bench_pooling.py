"""`pagedllm bench throughput --runner pooling`: embed N sentences (random words of the model's
vocabulary, 8-64 tokens each, fixed seed) and report sentences/s; with
`--compare-sentence-transformers`, `SentenceTransformer.encode(batch_size=32)` on the same
sentences, model and CPU in the same process, first."""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs


def add_pooling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compare-sentence-transformers", action="store_true",
                        help="with --runner pooling: also time sentence-transformers' encode(batch_size=32)")


def pooling_sentences(tokenizer: Any, num: int, seed: int = 0) -> list[str]:
    """`num` sentences of 8-64 tokens: whole words of the vocabulary, joined by spaces."""
    words = sorted(w for w in tokenizer.get_vocab() if w.isascii() and w.isalpha() and len(w) >= 3)
    rng = random.Random(seed)
    sentences = []
    while len(sentences) < num:
        target = rng.randint(8, 64)
        text = " ".join(rng.choice(words) for _ in range(target))
        ids = tokenizer(text).input_ids
        while len(ids) > 64:  # a word of several tokens: drop words until it fits
            text = text.rsplit(" ", 1)[0]
            ids = tokenizer(text).input_ids
        sentences.append(text)
    return sentences


def run_pooling_throughput(args: argparse.Namespace, engine_args: EngineArgs, tokenizer: Any) -> dict[str, Any]:
    from pagedllm.entrypoints.llm import LLM

    sentences = pooling_sentences(tokenizer, args.num_prompts)
    num_tokens = sum(len(tokenizer(s).input_ids) for s in sentences)
    metrics: dict[str, Any] = {"num_sentences": len(sentences), "num_tokens": num_tokens}
    lines = [f"{len(sentences)} sentences, {num_tokens} tokens (8-64 each)"]
    if args.compare_sentence_transformers:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ValueError("--compare-sentence-transformers needs sentence-transformers: "
                             "pip install -e \".[bench]\"") from None
        config = engine_args.create_engine_config()
        st = SentenceTransformer(config.model_config.model_path, device="cpu")
        st.encode(sentences[:32], batch_size=32)  # warm-up, as the engine warms up at start
        start = time.perf_counter()
        st.encode(sentences, batch_size=32)
        elapsed = time.perf_counter() - start
        metrics["sentence_transformers_sentences_per_second"] = len(sentences) / elapsed
        lines.append(f"sentence-transformers encode(batch_size=32): {len(sentences) / elapsed:.1f} sentences/s")
    start = time.perf_counter()
    llm = LLM(**vars(engine_args))
    metrics["startup_time_s"] = time.perf_counter() - start
    start = time.perf_counter()
    llm.embed(sentences, use_tqdm=False)
    elapsed = time.perf_counter() - start
    metrics["sentences_per_second"] = len(sentences) / elapsed
    lines.append(f"pagedllm embed: {len(sentences) / elapsed:.1f} sentences/s ({num_tokens / elapsed:.0f} tokens/s)")
    if "sentence_transformers_sentences_per_second" in metrics:
        ratio = metrics["sentences_per_second"] / metrics["sentence_transformers_sentences_per_second"]
        metrics["speedup_over_sentence_transformers"] = ratio
        lines.append(f"pagedllm / sentence-transformers: {ratio:.2f}x")
    return metrics | {"lines": lines}
