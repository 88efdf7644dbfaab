"""`pagedllm bench serve`: load an OpenAI-compatible server the way `vllm bench serve` does.

Prompts are token-id lists cut from the server's own tokenization of a fixed text (via
/tokenize), so their lengths are exact without a local tokenizer. Requests stream from
/v1/completions; TTFT, inter-token latency (ITL), time per output token (TPOT) and
end-to-end latency are measured per request on the client side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_WORDS = (
    "the of and to in is was for on that with as by at from his her an are which be this had not but "
    "what all were when we there can one has more if out so said who would up about into than them "
    "some time could only new two may first then do any like my now over such our man me even most"
).split()


def add_bench_serve_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("serve", help="online benchmark against a running server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    add_workload_args(p)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=lambda args: 0 if run_bench_serve(args) else 1)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload's flags, shared with `bench compare`."""
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one shared prefix (a system prompt) before every prompt's --input-len own tokens")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def check_workload_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if args.random_prefix_len < 0:
        raise ValueError("--random-prefix-len must be >= 0")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


async def _prompts(client, args: argparse.Namespace, model: str) -> list[list[int]]:
    """`num_prompts` token-id prompts: the shared prefix (if any), then `input_len` tokens cut
    from a random place in the text, so prompts differ right after the prefix."""
    rng = random.Random(args.seed)
    text = " ".join(rng.choice(_WORDS) for _ in range(max(64, args.input_len * 2)))
    ids = await _tokenize(client, model, text)
    while len(ids) < args.input_len + args.num_prompts:
        ids = ids + ids
    prefix = [ids[i % len(ids)] for i in range(args.random_prefix_len)]
    starts = [rng.randrange(0, len(ids) - args.input_len) for _ in range(args.num_prompts)]
    return [prefix + ids[s : s + args.input_len] for s in starts]


async def _tokenize(client, model: str, text: str) -> list[int]:
    """The server's token ids for `text`: pagedllm's and vLLM's /tokenize, else llama.cpp's."""
    bodies = ({"model": model, "prompt": text, "add_special_tokens": False}, {"content": text, "add_special": False})
    for body in bodies:
        resp = await client.post("/tokenize", json=body)
        tokens = resp.json().get("tokens") if resp.status_code == 200 else None
        if tokens and all(isinstance(t, int) for t in tokens):
            return tokens
    raise ValueError(f"{client.base_url}: no /tokenize that takes a vLLM or llama.cpp body (HTTP {resp.status_code})")


async def _one(client, model: str, prompt: list[int], args: argparse.Namespace) -> RequestResult:
    body = {
        "model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    start = last = time.perf_counter()
    text_chunks, usage, finish, error = 0, None, None, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("error"):  # a server's error event
                    error = chunk["error"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_tokens = usage["completion_tokens"]
                choice = (chunk.get("choices") or [{}])[0]
                finish = choice.get("finish_reason") or finish
                if choice.get("text"):
                    text_chunks += 1
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:  # say what came back, so a peer's failure can be told apart from ours
            result.error = (f"no completion tokens: {text_chunks} text chunks, finish_reason {finish!r}, "
                            f"usage {usage!r}" + (f", error {error!r}" if error else ""))
    except Exception as e:  # a failed request is counted, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as client:
        model = args.model
        if model is None:
            resp = await client.get("/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        prompts = await _prompts(client, args, model)
        sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
        rng = np.random.default_rng(args.seed)

        async def limited(prompt: list[int]) -> RequestResult:
            async with sem:
                return await _one(client, model, prompt, args)

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return _summarize(args, model, results, duration)


def _prompt_len(args: argparse.Namespace) -> int:
    return args.random_prefix_len + args.input_len


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    v = np.asarray(values_s or [0.0]) * 1000.0
    return {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.percentile(v, 50)),
            f"p90_{name}_ms": float(np.percentile(v, 90)), f"p99_{name}_ms": float(np.percentile(v, 99))}


def _summarize(args, model: str, results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    metrics: dict[str, Any] = {
        "model": model, "num_prompts": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate, "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + len(ok) * _prompt_len(args)) / duration,
        "total_output_tokens": out_tokens,
        **_stats("ttft", [r.ttft for r in ok]), **_stats("tpot", tpot),
        **_stats("itl", [x for r in ok for x in r.itl]), **_stats("e2el", [r.latency for r in ok]),
    }
    errors = [r.error for r in results if not r.ok]
    if errors:
        metrics["first_error"] = errors[0]
    return metrics


def run_bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    check_workload_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the report
    metrics = asyncio.run(_run(args))
    print(f"============ Serving Benchmark Result ({metrics['model']}) ============")
    print(f"Successful requests: {metrics['completed']} / {metrics['num_prompts']}"
          f"   (concurrency {args.max_concurrency or 'unbounded'}, rate {args.request_rate})")
    print(f"Duration: {metrics['duration_s']:.2f} s")
    print(f"Request throughput: {metrics['request_throughput']:.2f} req/s")
    print(f"Output token throughput: {metrics['output_throughput']:.2f} tok/s")
    print(f"Total token throughput: {metrics['total_token_throughput']:.2f} tok/s")
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        print(f"{label:12s} mean {metrics[f'mean_{name}_ms']:9.2f} ms   p50 {metrics[f'median_{name}_ms']:9.2f} ms"
              f"   p99 {metrics[f'p99_{name}_ms']:9.2f} ms")
    if metrics.get("first_error"):
        print(f"First error: {metrics['first_error']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(metrics, f, indent=2)
    return metrics
