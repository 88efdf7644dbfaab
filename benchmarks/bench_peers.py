"""pagedllm beside llama.cpp on the same GGUF, in one run, printed as one table:

- W1: 64 prompts x 32 tokens in (`--input-len`), 128 out, greedy, ignore_eos (`pagedllm bench
  throughput`; `llama-batched-bench -npp 32 -ntg 128 -npl 64`, output tokens over its total time);
- W2: batch 1, 128 tokens out (`pagedllm bench latency` TPOT; `llama-bench -n 128`);
- long prompt: prefill tok/s of one 4,096-token prompt (`pagedllm bench latency
  --input-len 4096 --output-len 1`, TTFT; `llama-bench -p 4096`);
- start-up: pagedllm's engine start-up to ready, with a warm cache (`bench latency`); and
  launch to a healthy server, `pagedllm serve` on a first start (an empty PAGEDLLM_CACHE_DIR:
  the GGUF's config and tokenizer, kernel build) and again warm, beside llama-server, each then
  answering one completion, with the peak RSS of its processes;
- serving (`pagedllm bench compare`: random 128 in / 128 out, 64 prompts, 16 concurrent,
  ignore_eos) against `pagedllm serve` and `llama-server -np 16`: output tok/s, median TTFT,
  P99 ITL;
- prefix-heavy serving: 32 prompts sharing a 1,024-token prefix (+ 32 own tokens, 32 out,
  4 concurrent) against `pagedllm serve` with prefix caching on and off: median TTFT.

    python benchmarks/bench_peers.py --llama-cpp-bin /path/to/llama.cpp/build/bin [--rounds 2]
    python benchmarks/bench_peers.py --llama-cpp-bin BIN --gguf gemma3-12b-q4_k_m.gguf --parts batch1,start \
        -- --max-model-len 8192 --kv-cache-memory 4GiB

llama.cpp is a peer, never a dependency: build it in a scratch directory (docs/performance.md
says how). Both sides use all cores (`-t`: os.cpu_count()). Rounds alternate the engines, so
drift on a shared machine hits both.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator

from pagedllm.entrypoints.cli.bench_compare import LaunchedServer, launched_server, pagedllm_serve_cmd

SERVE = ["--num-prompts", "64", "--input-len", "128", "--output-len", "128", "--max-concurrency", "16"]
PREFIX = ["--num-prompts", "32", "--random-prefix-len", "1024", "--input-len", "32", "--output-len", "32",
          "--max-concurrency", "4"]


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.stdout + proc.stderr


def _grab(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        sys.exit(f"no match for {pattern!r} in:\n{text[-3000:]}")
    return float(m.group(1))


def batch1_runs(extra: list[str]) -> dict[str, float]:
    """W2 alone (the part that a 12B finishes in minutes)."""
    w2 = _run(["pagedllm", "bench", "latency", "--input-len", "32", "--output-len", "128", "--batch-size", "1",
               *extra])
    return {"W2 ms/token": _grab(r"TPOT: ([0-9.]+) ms/token", w2),
            "start-up s": _grab(r"startup time: ([0-9.]+) s", w2)}


def llama_batch1_runs(bin_dir: str, gguf: str, threads: int) -> dict[str, float]:
    rows = list(csv.DictReader(io.StringIO(_run(
        [os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-p", "0", "-n", "128", "-r", "2",
         "-o", "csv"]))))
    return {"W2 ms/token": 1e3 / float(rows[0]["avg_ts"])}


def w1_runs(extra: list[str], input_len: int = 32) -> dict[str, float]:
    """W1 alone: 64 prompts of input_len tokens, 128 out each. llama-batched-bench is given the
    context the batch needs; pagedllm's --kv-cache-memory must hold 64 x (input_len + 128)
    tokens too (at 4B, 16,384 float32 tokens take 4.6 GB), or requests are preempted and
    recomputed: the table then says how many."""
    w1 = _run(["pagedllm", "bench", "throughput", "--num-prompts", "64", "--input-len", str(input_len),
               "--output-len", "128", *extra])
    preempted = re.search(r"Preemptions: ([0-9]+)", w1)
    return {"W1 output tok/s": _grab(r"([0-9.]+) output tokens/s", w1),
            **({"W1 preemptions": float(preempted.group(1))} if preempted else {})}


def llama_w1_runs(bin_dir: str, gguf: str, threads: int, input_len: int = 32) -> dict[str, float]:
    out = _run([os.path.join(bin_dir, "llama-batched-bench"), "-m", gguf, "-t", str(threads),
                "-c", str(64 * (input_len + 128)), "-npp", str(input_len), "-ntg", "128", "-npl", "64"])
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    row = next(line for line in out.splitlines() if re.match(rf"\|\s+{input_len}\s+\|\s+128\s+\|\s+64\s+\|", line))
    cells = [c.strip() for c in row.strip("|").split("|")]
    return {"W1 output tok/s": 64 * 128 / float(cells[8])}


def pagedllm_runs(extra: list[str], input_len: int = 32) -> dict[str, float]:
    long = _run(["pagedllm", "bench", "latency", "--input-len", "4096", "--output-len", "1", "--batch-size", "1",
                 "--num-iters", "1", *extra])
    return {**w1_runs(extra, input_len), **batch1_runs(extra),
            "prefill 4096 tok/s": 4096 / (_grab(r"TTFT: ([0-9.]+) ms", long) / 1e3)}


def llama_cpp_runs(bin_dir: str, gguf: str, threads: int, input_len: int = 32) -> dict[str, float]:
    bench = os.path.join(bin_dir, "llama-bench")
    rows = list(csv.DictReader(io.StringIO(_run(
        [bench, "-m", gguf, "-t", str(threads), "-p", "0,4096", "-n", "128,0", "-r", "3", "-o", "csv"]))))
    tg = next(float(r["avg_ts"]) for r in rows if r["n_gen"] == "128")
    pp = next(float(r["avg_ts"]) for r in rows if r["n_prompt"] == "4096")
    return {**llama_w1_runs(bin_dir, gguf, threads, input_len), "W2 ms/token": 1e3 / tg, "prefill 4096 tok/s": pp}


def _compare(gguf: str, workload: list[str], server_args: list[str], urls: list[str] = ()) -> dict[str, dict]:
    """`pagedllm bench compare`: a `pagedllm serve` it starts itself, plus the servers at `urls`.
    A run where any server failed a request is run once more (its table and errors printed);
    a second such run ends the script."""
    cmd = ["pagedllm", "bench", "compare", "--model", gguf, f"--server-args={' '.join(server_args)}",
           *(f for url in urls for f in ("--url", url)), *workload]
    for attempt in (1, 2):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = subprocess.run([*cmd, "--output-json", out.name], capture_output=True, text=True)
            results = json.load(open(out.name)) if os.path.getsize(out.name) else {}
        failed = {name: m.get("first_error") or m.get("error") for name, m in results.items()
                  if m.get("failed") or m.get("error")}
        if proc.returncode == 0 and results and not failed:
            return results
        print(f"serving run {attempt} had failures: {failed or proc.returncode}\n{proc.stdout[-2000:]}",
              file=sys.stderr)
    sys.exit(f"failed twice: {' '.join(cmd)}\n{proc.stderr[-2000:]}")


@contextlib.contextmanager
def llama_server(bin_dir: str, gguf: str, threads: int) -> Iterator[LaunchedServer]:
    """`llama-server -np 16` on a free port: 16 slots of 1,024 tokens each."""
    def cmd(port: int) -> list[str]:
        return [os.path.join(bin_dir, "llama-server"), "-m", gguf, "-t", str(threads), "-np", "16",
                "-c", str(16 * 1024), "--host", "127.0.0.1", "--port", str(port)]

    with launched_server("llama-server", cmd, timeout=120) as server:
        yield server


def _served(server: LaunchedServer, figures: dict[str, float]) -> None:
    """One completion through the started server (it serves, not only starts), then the peak
    resident set of its processes so far."""
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        if not json.load(resp)["choices"][0]["text"]:
            sys.exit(f"{server.url} answered an empty completion")
    figures["serve peak RSS GB"] = server.peak_rss_bytes() / 1e9


def start_up_runs(bin_dir: str, gguf: str, threads: int, extra: list[str]) -> tuple[dict, dict]:
    """Seconds from launch to a healthy server: `pagedllm serve` on an empty PAGEDLLM_CACHE_DIR
    (the GGUF's config and tokenizer, kernel build), then again on the cache that start left;
    llama-server beside it. Each then answers one completion; the peak RSS is taken after it."""
    mine, theirs = {}, {}
    with tempfile.TemporaryDirectory(prefix="pagedllm-first-start-") as cache:
        for key in ("serve ready s, first start", "serve ready s, warm cache"):
            with launched_server("pagedllm-serve", pagedllm_serve_cmd(gguf, shlex.join(extra)), timeout=900,
                                 env={"PAGEDLLM_CACHE_DIR": cache}) as server:
                mine[key] = server.ready_s
                _served(server, mine)
    with llama_server(bin_dir, gguf, threads) as server:
        theirs["serve ready s, warm cache"] = server.ready_s
        _served(server, theirs)
    return mine, theirs


def serving_runs(bin_dir: str, gguf: str, threads: int, extra: list[str]) -> tuple[dict, dict]:
    """(pagedllm's, llama-server's) serving figures from one round."""
    with llama_server(bin_dir, gguf, threads) as server:
        both = _compare(gguf, SERVE, extra, [f"llama.cpp={server.url}"])
    return tuple(  # type: ignore[return-value]
        {"serve output tok/s": m["output_throughput"], "serve TTFT p50 ms": m["median_ttft_ms"],
         "serve ITL p99 ms": m["p99_itl_ms"]}
        for m in (both["pagedllm"], both["llama.cpp"]))


def prefix_runs(gguf: str, extra: list[str]) -> dict[str, float]:
    """pagedllm's median TTFT on the shared-prefix workload, prefix caching on and off."""
    on = _compare(gguf, PREFIX, extra)["pagedllm"]
    off = _compare(gguf, PREFIX, [*extra, "--no-enable-prefix-caching"])["pagedllm"]
    return {"prefix TTFT p50 ms, caching on": on["median_ttft_ms"],
            "prefix TTFT p50 ms, caching off": off["median_ttft_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-bin", required=True, help="directory with llama-bench, llama-batched-bench")
    parser.add_argument("--gguf", default=None, help="default: the default model's GGUF")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=32, help="W1's prompt length (the issue's real sizes: 128)")
    parser.add_argument("--parts", default="offline,start,serve,prefix",
                        help="comma-separated subset of offline (W1, W2, prefill, start-up), w1 (W1 alone), "
                             "batch1 (W2 alone), start (server start-up, first and warm, and peak RSS), serve, prefix")
    parser.add_argument("pagedllm_args", nargs="*", help="extra arguments for every pagedllm command (after --)")
    args = parser.parse_args()
    if args.gguf is None:
        from pagedllm.transformers_utils.default_model import resolve_default_model

        offline_args = args.pagedllm_args
        args.gguf = resolve_default_model()
    else:
        offline_args = ["--model", args.gguf, *args.pagedllm_args]
    threads = os.cpu_count() or 1
    ours: dict[str, list[float]] = {}
    peer: dict[str, list[float]] = {}
    parts = set(args.parts.split(","))
    for _ in range(args.rounds):
        mine: dict[str, float] = {}
        theirs: dict[str, float] = {}
        if "offline" in parts:
            mine |= pagedllm_runs(offline_args, args.input_len)
            theirs |= llama_cpp_runs(args.llama_cpp_bin, args.gguf, threads, args.input_len)
        if "w1" in parts and "offline" not in parts:
            mine |= w1_runs(offline_args, args.input_len)
            theirs |= llama_w1_runs(args.llama_cpp_bin, args.gguf, threads, args.input_len)
        if "batch1" in parts and "offline" not in parts:
            mine |= batch1_runs(offline_args)
            theirs |= llama_batch1_runs(args.llama_cpp_bin, args.gguf, threads)
        if "start" in parts:
            start_mine, start_theirs = start_up_runs(args.llama_cpp_bin, args.gguf, threads, args.pagedllm_args)
            mine |= start_mine
            theirs |= start_theirs
        if "serve" in parts:
            serve_mine, serve_theirs = serving_runs(args.llama_cpp_bin, args.gguf, threads, args.pagedllm_args)
            mine |= serve_mine
            theirs |= serve_theirs
        if "prefix" in parts:
            mine |= prefix_runs(args.gguf, args.pagedllm_args)
        for key, value in mine.items():
            ours.setdefault(key, []).append(value)
        for key, value in theirs.items():
            peer.setdefault(key, []).append(value)
    print(f"| metric | pagedllm | llama.cpp | pagedllm / llama.cpp |  ({threads} threads, {args.rounds} round(s))")
    print("| --- | --- | --- | --- |")
    for key, values in ours.items():
        runs = " / ".join(f"{v:.1f}" for v in values)
        if key not in peer:
            print(f"| {key} | {runs} | | |")
            continue
        a, b = statistics.median(values), statistics.median(peer[key])
        ratio = b / a if " ms" in key or key.startswith("serve ready") or "RSS" in key else a / b  # > 1: pagedllm ahead
        peer_runs = " / ".join(f"{v:.1f}" for v in peer[key])
        print(f"| {key} | {runs} | {peer_runs} | {ratio:.2f}x |")
    if "prefix" in parts:
        on, off = (statistics.median(ours[f"prefix TTFT p50 ms, caching {x}"]) for x in ("on", "off"))
        print(f"prefix caching: median TTFT {off / on:.1f}x lower with it on")


if __name__ == "__main__":
    main()
