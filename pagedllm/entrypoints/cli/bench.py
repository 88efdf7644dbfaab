"""`pagedllm bench throughput|latency`: offline benchmarks in the style of `vllm bench`.

Both build their workload as token-id prompts so that tokenization is not measured and the
pagedllm and transformers backends see exactly the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass, replace
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli.bench_lora import add_lora_bench_args, lora_requests
from pagedllm.entrypoints.cli.bench_mm import RANDOM_MM, add_mm_bench_args, random_mm_prompts, run_hf_mm
from pagedllm.entrypoints.cli.bench_pooling import add_pooling_args
from pagedllm.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace

_PROMPT_SEED = 0  # fixed, so every run (and both backends) gets the same prompts


def add_bench_parser(subparsers) -> None:
    """Register `bench throughput` and `bench latency` on the top-level subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark the offline engine")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    tp = sub.add_parser("throughput", help="offline throughput: all prompts in one generate call")
    add_engine_args(tp)
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", type=int, default=32, help="prompt tokens (random prompts)")
    tp.add_argument("--output-len", type=int, default=128)
    add_mm_bench_args(tp)
    tp.add_argument("--dataset", default=None,
                    help='JSON/JSONL of {"prompt": ...} or a text file, one prompt per line')
    tp.add_argument("--backend", choices=["pagedllm", "transformers"], default="pagedllm")
    tp.add_argument("--hf-batch-size", type=int, default=16, help="transformers backend batch size")
    _add_sampling_args(tp)
    tp.add_argument("--compare-greedy", action="store_true",
                    help="also time the same workload greedily in the same engine, right before: sampling cost "
                         "without the process-to-process variation (~10%% here)")
    tp.add_argument("--output-json", default=None)
    add_pooling_args(tp)
    _add_structured_output_arg(tp)
    add_lora_bench_args(tp)
    tp.add_argument("--compare-unconstrained", action="store_true",
                    help="with --structured-output-json: also time the workload without the schema in the same "
                         "engine, right before")
    tp.set_defaults(func=_throughput_cmd)

    lat = sub.add_parser("latency", help="latency of one batch: end-to-end, TTFT and TPOT")
    add_engine_args(lat)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--output-json", default=None)
    _add_sampling_args(lat)
    _add_structured_output_arg(lat)
    lat.set_defaults(func=_latency_cmd)

    from pagedllm.entrypoints.cli.bench_compare import add_bench_compare_parser
    from pagedllm.entrypoints.cli.bench_serve import add_bench_serve_parser

    add_bench_serve_parser(sub)
    add_bench_compare_parser(sub)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Every request's sampling (greedy by default; seeded rows take --seed)."""
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def _add_structured_output_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--structured-output-json", default=None, metavar="SCHEMA",
                        help="constrain every request to this JSON schema (inline JSON or a file): the cost of "
                             "the grammar. Pick one that outlasts --output-len (e.g. benchmarks/schemas/"
                             "long_array.json), since a completed grammar ends its request")


def _sampling_params(args: argparse.Namespace, **kwargs: Any) -> Any:
    """The benchmark's SamplingParams: EOS ignored, no detokenizing, and the schema if given."""
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

    schema = getattr(args, "structured_output_json", None)
    if schema is not None and os.path.isfile(schema):
        with open(schema, encoding="utf-8") as f:
            schema = f.read()
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    return SamplingParams(max_tokens=args.output_len, ignore_eos=True, detokenize=False, structured_outputs=so,
                          **kwargs)


def _throughput_cmd(args: argparse.Namespace) -> int:
    """The CLI main wants an exit code; run_throughput/run_latency return metrics for tests."""
    return 0 if run_throughput(args) else 1


def _latency_cmd(args: argparse.Namespace) -> int:
    return 0 if run_latency(args) else 1


def _load_tokenizer(config: EngineConfig) -> Any:
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    mc = config.model_config
    return get_tokenizer(mc.tokenizer, mc.trust_remote_code)


def _random_prompts(config: EngineConfig, tokenizer: Any, num: int, length: int) -> list[list[int]]:
    """Uniform token ids from the vocabulary, minus special/added tokens (which a real text
    prompt would not contain and which can trigger odd model behaviour)."""
    if length < 1:
        raise ValueError(f"--input-len must be >= 1, got {length}")
    vocab = min(config.model_config.text_config.vocab_size, len(tokenizer))
    banned = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    allowed = [t for t in range(vocab) if t not in banned]
    rng = random.Random(_PROMPT_SEED)
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(num)]


def _dataset_prompts(path: str, tokenizer: Any, num: int) -> list[list[int]]:
    """Prompts from a file, tokenized once and cycled to `num` requests."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".jsonl"):
        items: list[Any] = [json.loads(line) for line in text.splitlines() if line.strip()]
    elif path.endswith(".json"):
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of prompts")
    else:
        items = [line for line in text.splitlines() if line.strip()]
    texts = [it["prompt"] if isinstance(it, dict) else str(it) for it in items]
    if not texts:
        raise ValueError(f"{path}: no prompts found")
    ids = [tokenizer.encode(t) for t in texts]
    return [ids[i % len(ids)] for i in range(num)]


def _report(metrics: dict[str, Any], lines: list[str], output_json: str | None) -> dict[str, Any]:
    for line in lines:
        print(line)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(metrics, f, indent=2)
    return metrics


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Time one batch of `num_prompts` requests; returns the metrics (also printed)."""
    if args.num_prompts < 1 or args.output_len < 1:
        raise ValueError("--num-prompts and --output-len must be >= 1")
    engine_args = engine_args_from_namespace(args)
    config = engine_args.create_engine_config()  # resolves the model path (and GGUF cache) once
    tokenizer = _load_tokenizer(config)
    if config.model_config.runner == "pooling":
        from pagedllm.entrypoints.cli.bench_pooling import run_pooling_throughput

        metrics = run_pooling_throughput(args, engine_args, tokenizer)
        return _report(metrics, metrics.pop("lines"), args.output_json)
    image_prompts = args.dataset == RANDOM_MM
    if image_prompts:
        prompts = random_mm_prompts(config, tokenizer, args)
    elif args.dataset:
        prompts = _dataset_prompts(args.dataset, tokenizer, args.num_prompts)
    else:
        prompts = _random_prompts(config, tokenizer, args.num_prompts, args.input_len)

    if args.backend == "transformers" and image_prompts:
        run = BatchRun(*run_hf_mm(args, config, prompts))
    elif args.backend == "transformers":
        run = _run_hf(args, config, tokenizer, prompts)
    else:
        del tokenizer  # the engine loads its own; a second 262k-vocab tokenizer would count in its RSS
        run = _run_pagedllm(args, engine_args, prompts)
    elapsed = max(run.elapsed, 1e-9)
    metrics = {
        "backend": args.backend,
        "num_requests": len(prompts),
        "num_prompt_tokens": run.prompt_tokens,
        "num_output_tokens": run.output_tokens,
        "startup_time_s": run.startup,
        "elapsed_time_s": elapsed,
        "requests_per_second": len(prompts) / elapsed,
        "output_tokens_per_second": run.output_tokens / elapsed,
        "total_tokens_per_second": (run.prompt_tokens + run.output_tokens) / elapsed,
    }
    lines = []
    if run.preemptions is not None:
        metrics["num_preemptions"] = run.preemptions
        if run.preemptions:  # a batch that outgrew the KV cache: requests recomputed, the figure is not the kernels'
            lines.append(f"Preemptions: {run.preemptions} (the KV cache held fewer tokens than the batch grew to; "
                         "--kv-cache-memory raises it)")
    for name in ("greedy", "unconstrained", "no_lora"):
        if hasattr(args, f"{name}_output_tokens_per_second"):
            metrics[f"{name}_output_tokens_per_second"] = getattr(args, f"{name}_output_tokens_per_second")
    return _report(metrics, [
        f"Backend: {args.backend}",
        f"Engine startup time: {run.startup:.2f} s",
        f"Processed {len(prompts)} requests, {run.prompt_tokens} prompt + {run.output_tokens} output tokens "
        f"in {elapsed:.2f} s",
        f"Throughput: {metrics['requests_per_second']:.2f} requests/s, "
        f"{metrics['output_tokens_per_second']:.2f} output tokens/s, "
        f"{metrics['total_tokens_per_second']:.2f} total tokens/s",
        *lines,
    ], args.output_json)


@dataclass(slots=True)
class BatchRun:
    """One timed batch: seconds to load, seconds to generate, and the tokens it covered."""

    startup: float
    elapsed: float
    output_tokens: int
    prompt_tokens: int  # as the engine counts them: an image's placeholders included
    preemptions: int | None = None  # the engine's count; transformers has no KV cache to outgrow


def _run_pagedllm(args: argparse.Namespace, engine_args: EngineArgs, prompts: list[list[int]]) -> BatchRun:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(**vars(engine_args))
    startup = time.perf_counter() - start
    params = _sampling_params(args, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    baselines = []  # the same workload in the same engine, run first: no process-to-process variation
    if getattr(args, "compare_greedy", False):
        baselines.append(("greedy", SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                                                   detokenize=False)))
    if getattr(args, "compare_unconstrained", False):
        baselines.append(("unconstrained", SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.output_len,
            ignore_eos=True, detokenize=False)))
    if getattr(args, "compare_no_lora", False):
        baselines.append(("no_lora", params))
    loras = lora_requests(args, llm.llm_engine.config.model_config.text_config, len(prompts)) \
        if getattr(args, "enable_lora", False) else None
    if params.structured_outputs is not None:  # the first grammar loads the tokenizer's tables (seconds): not timed
        llm.generate(prompts[:1], replace(params, max_tokens=1), use_tqdm=False)
    if loras is not None:  # adapters load from disk on first use: not timed
        llm.generate(prompts[:len(set(loras))], replace(params, max_tokens=1), use_tqdm=False,
                     lora_request=loras[:len(set(loras))])
    for name, baseline in baselines:
        start = time.perf_counter()
        outputs = llm.generate(prompts, baseline, use_tqdm=False)
        tps = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
        setattr(args, f"{name}_output_tokens_per_second", tps)
        print(f"{name.capitalize()} (same engine, run first): {tps:.2f} output tokens/s")
        llm.llm_engine.reset_prefix_cache()
    preempted = llm.get_metrics()["pagedllm:num_preemptions"]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True, lora_request=loras)
    elapsed = time.perf_counter() - start
    return BatchRun(startup, elapsed, sum(len(o.outputs[0].token_ids) for o in outputs),
                    sum(len(o.prompt_token_ids) for o in outputs),
                    int(llm.get_metrics()["pagedllm:num_preemptions"] - preempted))


def _run_hf(
    args: argparse.Namespace, config: EngineConfig, tokenizer: Any, prompts: list[list[int]]
) -> BatchRun:
    """The same workload through transformers' generate: left-padded batches, EOS ignored
    via min_new_tokens, so the token counts match pagedllm's."""
    import torch
    from transformers import AutoModelForCausalLM

    mc, device = config.model_config, config.device_config.device
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        mc.model_path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code
    ).to(device).eval()
    startup = time.perf_counter() - start
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sample = args.temperature > 0
    gen_kwargs: dict[str, Any] = dict(
        max_new_tokens=args.output_len, min_new_tokens=args.output_len,
        do_sample=sample, pad_token_id=pad_id,
    )
    if sample:
        gen_kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    bs = max(1, args.hf_batch_size)
    num_output = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), bs):
        batch = prompts[i:i + bs]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
        num_output += (out.shape[1] - width) * out.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return BatchRun(startup, time.perf_counter() - start, num_output, sum(len(p) for p in prompts))


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Average end-to-end latency of one batch, with TTFT and TPOT from request metrics."""
    from pagedllm.entrypoints.llm import LLM

    if args.batch_size < 1 or args.output_len < 1 or args.num_iters < 1:
        raise ValueError("--batch-size, --output-len and --num-iters must be >= 1")
    engine_args = engine_args_from_namespace(args)
    config = engine_args.create_engine_config()
    prompts = _random_prompts(config, _load_tokenizer(config), args.batch_size, args.input_len)
    start = time.perf_counter()
    llm = LLM(**vars(engine_args))
    startup = time.perf_counter() - start
    params = _sampling_params(args, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)

    def one_iter() -> tuple[float, list[Any]]:
        llm.llm_engine.reset_prefix_cache()  # each iteration must prefill from scratch
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, outs

    for _ in range(args.num_iters_warmup):
        one_iter()
    latencies, ttfts, tpots, num_output = [], [], [], 0
    for _ in range(args.num_iters):
        latency, outs = one_iter()
        latencies.append(latency)
        for o in outs:
            m, n = o.metrics, len(o.outputs[0].token_ids)
            num_output += n
            if m is None or m.first_token_time is None:
                continue
            ttfts.append((m.first_token_time - m.arrival_time) * 1000)
            last = m.last_token_time or m.finished_time
            if n > 1 and last is not None:
                tpots.append((last - m.first_token_time) / (n - 1) * 1000)

    avg_latency = sum(latencies) / len(latencies)
    avg_ttft = sum(ttfts) / len(ttfts) if ttfts else None
    avg_tpot = sum(tpots) / len(tpots) if tpots else None
    metrics = {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "sampling": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k},
        "num_output_tokens": num_output // args.num_iters,  # per iteration
        "startup_time_s": startup,
        "avg_latency_s": avg_latency,
        "latencies_s": latencies,
        "avg_ttft_ms": avg_ttft,
        "avg_tpot_ms": avg_tpot,
        "output_tokens_per_second": num_output / max(sum(latencies), 1e-9),
        "decode_tokens_per_second_per_seq": 1000 / avg_tpot if avg_tpot else None,
    }
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    return _report(metrics, [
        f"Engine startup time: {startup:.2f} s",
        f"Avg latency: {avg_latency:.4f} s (batch {args.batch_size}, {args.input_len} in, "
        f"{args.output_len} out, {args.num_iters} iters)",
        f"TTFT: {fmt(avg_ttft)} ms",
        f"TPOT: {fmt(avg_tpot)} ms/token",
        f"Throughput: {metrics['output_tokens_per_second']:.2f} output tokens/s "
        f"({fmt(metrics['decode_tokens_per_second_per_seq'])} decode tokens/s per sequence)",
    ], args.output_json)
