"""pagedllm beside llama.cpp on the same GGUF, in one run, printed as one table:

- W1: 64 prompts x 32 tokens in, 128 out, greedy, ignore_eos (`pagedllm bench throughput`;
  `llama-batched-bench -npp 32 -ntg 128 -npl 64`, output tokens over its total time);
- W2: batch 1, 128 tokens out (`pagedllm bench latency` TPOT; `llama-bench -n 128`);
- long prompt: prefill tok/s of one 4,096-token prompt (`pagedllm bench latency
  --input-len 4096 --output-len 1`, TTFT; `llama-bench -p 4096`);
- start-up: pagedllm's engine start-up to ready, with a warm cache.

    python benchmarks/bench_peers.py --llama-cpp-bin /path/to/llama.cpp/build/bin [--rounds 2]

llama.cpp is a peer, never a dependency: build it in a scratch directory (docs/performance.md
says how). Both sides use all cores (`-t`: os.cpu_count()). Rounds alternate the engines, so
drift on a shared machine hits both.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import statistics
import subprocess
import sys


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


def pagedllm_runs(extra: list[str]) -> dict[str, float]:
    w1 = _run(["pagedllm", "bench", "throughput", "--num-prompts", "64", "--input-len", "32", "--output-len", "128",
               *extra])
    w2 = _run(["pagedllm", "bench", "latency", "--input-len", "32", "--output-len", "128", "--batch-size", "1",
               *extra])
    long = _run(["pagedllm", "bench", "latency", "--input-len", "4096", "--output-len", "1", "--batch-size", "1",
                 "--num-iters", "1", *extra])
    return {
        "W1 output tok/s": _grab(r"([0-9.]+) output tokens/s", w1),
        "W2 ms/token": _grab(r"TPOT: ([0-9.]+) ms/token", w2),
        "prefill 4096 tok/s": 4096 / (_grab(r"TTFT: ([0-9.]+) ms", long) / 1e3),
        "start-up s": _grab(r"startup time: ([0-9.]+) s", w2),
    }


def llama_cpp_runs(bin_dir: str, gguf: str, threads: int) -> dict[str, float]:
    bench = os.path.join(bin_dir, "llama-bench")
    rows = list(csv.DictReader(io.StringIO(_run(
        [bench, "-m", gguf, "-t", str(threads), "-p", "0,4096", "-n", "128,0", "-r", "3", "-o", "csv"]))))
    tg = next(float(r["avg_ts"]) for r in rows if r["n_gen"] == "128")
    pp = next(float(r["avg_ts"]) for r in rows if r["n_prompt"] == "4096")
    out = _run([os.path.join(bin_dir, "llama-batched-bench"), "-m", gguf, "-t", str(threads), "-c", str(64 * 160),
                "-npp", "32", "-ntg", "128", "-npl", "64"])
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    row = next(line for line in out.splitlines() if re.match(r"\|\s+32\s+\|\s+128\s+\|\s+64\s+\|", line))
    cells = [c.strip() for c in row.strip("|").split("|")]
    return {"W1 output tok/s": 64 * 128 / float(cells[8]), "W2 ms/token": 1e3 / tg, "prefill 4096 tok/s": pp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-bin", required=True, help="directory with llama-bench, llama-batched-bench")
    parser.add_argument("--gguf", default=None, help="default: the default model's GGUF")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("pagedllm_args", nargs="*", help="extra arguments for every pagedllm command (after --)")
    args = parser.parse_args()
    if args.gguf is None:
        from pagedllm.transformers_utils.default_model import resolve_default_model

        args.gguf = resolve_default_model()
    threads = os.cpu_count() or 1
    ours: dict[str, list[float]] = {}
    peer: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for key, value in pagedllm_runs(args.pagedllm_args).items():
            ours.setdefault(key, []).append(value)
        for key, value in llama_cpp_runs(args.llama_cpp_bin, args.gguf, threads).items():
            peer.setdefault(key, []).append(value)
    print(f"| metric | pagedllm | llama.cpp | pagedllm / llama.cpp |  ({threads} threads, {args.rounds} round(s))")
    print("| --- | --- | --- | --- |")
    for key, values in ours.items():
        mine = statistics.median(values)
        theirs = statistics.median(peer[key]) if key in peer else None
        runs = " / ".join(f"{v:.1f}" for v in values)
        if theirs is None:
            print(f"| {key} | {runs} | | |")
            continue
        ratio = theirs / mine if key.endswith("ms/token") else mine / theirs  # > 1: pagedllm ahead
        peer_runs = " / ".join(f"{v:.1f}" for v in peer[key])
        print(f"| {key} | {runs} | {peer_runs} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
