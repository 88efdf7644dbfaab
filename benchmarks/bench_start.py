"""Warm start-up of `pagedllm serve`, launch to a healthy /health, for one or more source trees
alternated in one run (each tree's `pagedllm` package is put first on PYTHONPATH, for the front
and the engine-core process alike), so a change is compared on the same machine at the same time.

    python benchmarks/bench_start.py --trees /path/to/base,/path/to/change --rounds 6 [-- serve args]

Round 0 of each tree warms its caches (bytecode, quantized weights) and is not counted. The
bytecode is written, as an installed package has it, even where PYTHONDONTWRITEBYTECODE is set."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def launch_to_healthy(tree: str, serve_args: list[str], timeout_s: float = 300) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", *serve_args,
                             "--port", str(port), "--uvicorn-log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    try:
        while time.perf_counter() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"pagedllm serve from {tree} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    return time.perf_counter() - start
            except OSError:
                time.sleep(0.02)
        raise TimeoutError(f"pagedllm serve from {tree} not healthy in {timeout_s} s")
    finally:
        proc.terminate()  # the front stops its engine core before it exits
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", required=True, help="comma-separated source trees (repository roots)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("serve_args", nargs="*",
                        help="after --: arguments for pagedllm serve (default: the default model)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    trees = args.trees.split(",")
    results: dict[str, list[float]] = {tree: [] for tree in trees}
    for round_ in range(args.rounds + 1):
        for tree in trees:
            seconds = launch_to_healthy(tree, args.serve_args)
            if round_:
                results[tree].append(seconds)
            time.sleep(1)
    print("| tree | median s | min s | all s |\n| --- | --- | --- | --- |")
    for tree, times in results.items():
        print(f"| {tree} | {statistics.median(times):.2f} | {min(times):.2f} | "
              f"{' / '.join(f'{t:.2f}' for t in times)} |")


if __name__ == "__main__":
    main()
