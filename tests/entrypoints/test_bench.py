"""`pagedllm bench throughput|latency` on a tiny random-weight model, both backends."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedllm.entrypoints.cli.bench import add_bench_parser, run_latency, run_throughput
from tests.utils import make_tiny_model

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 8, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), "llama")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedllm")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def _engine_flags(model_dir: str) -> list[str]:
    return ["--model", model_dir, "--device", "cpu", "--kv-cache-memory", "4MiB"]


@pytest.mark.parametrize("backend", ["pagedllm", "transformers"])
def test_throughput(model_dir: str, backend: str, tmp_path, capsys) -> None:
    out_json = tmp_path / "tp.json"
    args = _parse(["bench", "throughput", *_engine_flags(model_dir), "--backend", backend,
                   "--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN),
                   "--output-len", str(OUTPUT_LEN), "--hf-batch-size", "3",
                   "--output-json", str(out_json)])
    assert args.func.__name__ == "_throughput_cmd"
    m = run_throughput(args)
    assert m["backend"] == backend
    assert m["num_requests"] == NUM_PROMPTS
    assert m["num_prompt_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert m["num_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    for key in ("startup_time_s", "elapsed_time_s", "requests_per_second",
                "output_tokens_per_second", "total_tokens_per_second"):
        assert m[key] > 0, key
    assert json.loads(out_json.read_text()) == m
    printed = capsys.readouterr().out
    assert "Engine startup time:" in printed and "output tokens/s" in printed


def test_throughput_dataset_and_cli_exit_code(model_dir: str, tmp_path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Hello, my name is"}\n{"prompt": "The quick brown fox"}\n')
    args = _parse(["bench", "throughput", *_engine_flags(model_dir), "--dataset", str(data),
                   "--num-prompts", "3", "--output-len", str(OUTPUT_LEN)])
    assert args.func(args) == 0  # what the CLI main turns into the exit status
    m = run_throughput(args)
    assert m["num_requests"] == 3 and m["num_output_tokens"] == 3 * OUTPUT_LEN


def test_random_prompts_are_fixed_and_avoid_special_tokens(model_dir: str) -> None:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.cli.bench import _load_tokenizer, _random_prompts

    config = EngineArgs(model=model_dir, device="cpu").create_engine_config()
    tok = _load_tokenizer(config)
    a = _random_prompts(config, tok, 16, 32)
    assert a == _random_prompts(config, tok, 16, 32)
    flat = {t for p in a for t in p}
    assert not flat & set(tok.all_special_ids)
    assert all(0 <= t < len(tok) for t in flat)


def test_latency(model_dir: str, tmp_path, capsys) -> None:
    out_json = tmp_path / "lat.json"
    args = _parse(["bench", "latency", *_engine_flags(model_dir), "--batch-size", "2",
                   "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                   "--num-iters-warmup", "1", "--num-iters", "2", "--output-json", str(out_json)])
    assert args.func(args) == 0
    m = run_latency(args)
    assert m["num_output_tokens"] == 2 * OUTPUT_LEN
    assert len(m["latencies_s"]) == 2
    for key in ("startup_time_s", "avg_latency_s", "avg_ttft_ms", "avg_tpot_ms",
                "output_tokens_per_second", "decode_tokens_per_second_per_seq"):
        assert m[key] > 0, key
    assert m["avg_ttft_ms"] < m["avg_latency_s"] * 1000
    assert json.loads(out_json.read_text()) == m
    printed = capsys.readouterr().out
    assert "TTFT:" in printed and "TPOT:" in printed and "Avg latency:" in printed


def test_latency_with_sampling(model_dir: str) -> None:
    args = _parse(["bench", "latency", *_engine_flags(model_dir), "--input-len", str(INPUT_LEN), "--output-len",
                   str(OUTPUT_LEN), "--num-iters-warmup", "0", "--num-iters", "1", "--temperature", "0.8",
                   "--top-p", "0.95", "--top-k", "50"])
    m = run_latency(args)
    assert m["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 50}
    assert m["num_output_tokens"] == OUTPUT_LEN and m["avg_tpot_ms"] > 0


def test_throughput_sampling_with_greedy_baseline(model_dir: str, capsys) -> None:
    args = _parse(["bench", "throughput", *_engine_flags(model_dir), "--num-prompts", str(NUM_PROMPTS),
                   "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--temperature", "0.8",
                   "--top-p", "0.95", "--top-k", "50", "--compare-greedy"])
    m = run_throughput(args)
    assert m["greedy_output_tokens_per_second"] > 0 and m["output_tokens_per_second"] > 0
    assert m["num_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert "Greedy (same engine, run first)" in capsys.readouterr().out


def test_throughput_under_a_json_schema_with_unconstrained_baseline(model_dir: str, capsys) -> None:
    """Each request runs under the schema to --output-len (minItems keeps a completed grammar from
    ending it sooner), and the same workload without it is timed first in the same engine."""
    schema = '{"type": "array", "items": {"type": "integer", "maximum": 9}, "minItems": 100}'
    args = _parse(["bench", "throughput", *_engine_flags(model_dir), "--num-prompts", str(NUM_PROMPTS),
                   "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                   "--structured-output-json", schema, "--compare-unconstrained"])
    m = run_throughput(args)
    assert m["unconstrained_output_tokens_per_second"] > 0 and m["output_tokens_per_second"] > 0
    assert m["num_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert "Unconstrained (same engine, run first)" in capsys.readouterr().out


def test_pooling_throughput_beside_sentence_transformers(tmp_path) -> None:
    """`--runner pooling` on the default embedding model: sentences of 8-64 tokens, both timed."""
    args = _parse(["bench", "throughput", "--runner", "pooling", "--dtype", "float32", "--num-prompts", "40",
                   "--compare-sentence-transformers", "--output-json", str(tmp_path / "pool.json")])
    m = run_throughput(args)
    assert m["num_sentences"] == 40 and 40 * 8 <= m["num_tokens"] <= 40 * 64
    assert m["sentences_per_second"] > 0 and m["sentence_transformers_sentences_per_second"] > 0
    assert json.loads((tmp_path / "pool.json").read_text())["speedup_over_sentence_transformers"] > 0


def test_throughput_reports_the_preemptions_of_a_batch_that_outgrew_the_kv_cache(model_dir: str, capsys) -> None:
    """A figure taken while requests were recomputed measures the KV cache's size, not the engine:
    the count says so (8 prompts x 32 tokens against 6 blocks of 16)."""
    flags = ["--model", model_dir, "--device", "cpu", "--max-model-len", "64", "--num-gpu-blocks-override", "6"]
    m = run_throughput(_parse(["bench", "throughput", *flags, "--num-prompts", "8", "--input-len", "16",
                               "--output-len", "16"]))
    assert m["num_output_tokens"] == 8 * 16 and m["num_preemptions"] > 0
    assert f"Preemptions: {m['num_preemptions']} " in capsys.readouterr().out
    roomy = run_throughput(_parse(["bench", "throughput", *_engine_flags(model_dir), "--num-prompts", "2",
                                   "--input-len", "8", "--output-len", "4"]))
    assert roomy["num_preemptions"] == 0 and "Preemptions" not in capsys.readouterr().out
