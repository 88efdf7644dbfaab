"""`pagedllm bench compare`: `bench serve`'s workload against several OpenAI-compatible servers
(pagedllm, vLLM, llama.cpp's llama-server), one after the other, as one table and one plot.

With `--model` it also starts `pagedllm serve` itself for the comparison. Each server gets a few
warm-up requests first, so one-off start costs (kernel builds, caches) are not measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from pagedllm import envs
from pagedllm.entrypoints.cli.bench_serve import _run, add_workload_args, check_workload_args

LATENCIES = (("ttft", "median", "TTFT p50"), ("ttft", "p90", "TTFT p90"), ("ttft", "p99", "TTFT p99"),
             ("itl", "median", "ITL p50"), ("itl", "p99", "ITL p99"), ("tpot", "median", "TPOT p50"),
             ("tpot", "p99", "TPOT p99"))
MATPLOTLIB_MISSING = "--plot needs matplotlib: pip install 'pagedllm[bench]' (or pip install matplotlib)"


def _endpoint(value: str) -> tuple[str, str]:
    name, sep, url = value.partition("=")
    if not sep or not name.strip() or not url.strip().startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected NAME=http://host:port[/v1], got {value!r}")
    return name.strip(), url.strip().rstrip("/").removesuffix("/v1")


def add_bench_compare_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("compare", help="bench serve's workload against several servers: a table, a plot")
    p.add_argument("--url", action="append", type=_endpoint, default=[], metavar="NAME=URL",
                   help="a server to compare, e.g. vllm=http://localhost:8001/v1 (repeatable)")
    p.add_argument("--model", default=None,
                   help="also start `pagedllm serve MODEL` on a free port and compare it as --server-name")
    p.add_argument("--server-args", default="",
                   help="more flags for that server, in one string: --server-args='--dtype float32 -tp 2'")
    p.add_argument("--server-name", default="pagedllm", help="its name in the table (default: %(default)s)")
    p.add_argument("--server-timeout", type=float, default=600, help="seconds it may take to start")
    p.add_argument("--api-key", default=None, help="bearer key sent to every server")
    add_workload_args(p)
    p.add_argument("--warmup-prompts", type=int, default=2, help="requests per server before timing (default: 2)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="throughput and latency bars per server")
    p.add_argument("--output-json", default=None, help="every server's metrics")
    p.set_defaults(func=run_bench_compare)


def run_bench_compare(args: argparse.Namespace) -> int:
    import logging

    systems = list(args.url)
    names = [name for name, _ in systems] + ([args.server_name] if args.model else [])
    if not names:
        raise ValueError("nothing to compare: give --url NAME=URL (repeatable) and/or --model MODEL")
    if len(set(names)) != len(names):
        raise ValueError(f"each server needs its own name; got {', '.join(names)}")
    check_workload_args(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(MATPLOTLIB_MISSING) from None
    logging.getLogger("httpx").setLevel(logging.WARNING)
    results: dict[str, dict[str, Any]] = {}
    with _pagedllm_server(args) as url:
        if url is not None:
            systems.insert(0, (args.server_name, url))
        for name, base in systems:
            print(f"Benchmarking {name} at {base} ...", file=sys.stderr, flush=True)
            results[name] = _bench_one(args, base)
    print(format_table(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot:
        plot(results, args, args.plot)
        print(f"Plot: {args.plot}", file=sys.stderr)
    return 0 if all(not m.get("error") and m["failed"] == 0 for m in results.values()) else 1


def _bench_one(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    """One server's metrics, or {"error": ...} when it could not be measured at all."""
    run_args = argparse.Namespace(**{**vars(args), "base_url": base_url, "model": None})
    try:
        if args.warmup_prompts > 0:
            # Another seed: other prompts (and another shared prefix), so nothing timed is cached.
            warmup = argparse.Namespace(**{**vars(run_args), "num_prompts": args.warmup_prompts,
                                           "output_len": min(args.output_len, 4), "request_rate": float("inf"),
                                           "seed": args.seed + 1})
            asyncio.run(_run(warmup))
        return asyncio.run(_run(run_args))
    except Exception as e:  # an unreachable or refusing server: its row says so, the others still run
        message = f"{type(e).__name__}: {e}"
        print(f"  failed: {message}", file=sys.stderr)
        return {"error": message, "completed": 0, "failed": args.num_prompts}


def format_table(results: dict[str, dict[str, Any]]) -> str:
    header = ["System", "OK", "Req/s", "Out tok/s", *(label + " ms" for _, _, label in LATENCIES)]
    rows = [header] + [
        [name, f"{m['completed']}/{m['num_prompts']}", f"{m['request_throughput']:.2f}",
         f"{m['output_throughput']:.1f}",
         *(f"{m[f'{stat}_{metric}_ms']:.1f}" for metric, stat, _ in LATENCIES)]
        for name, m in results.items() if not m.get("error")]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines += [f"{name.ljust(widths[0])}  failed: {m['error']}" for name, m in results.items() if m.get("error")]
    lines += [f"{name.ljust(widths[0])}  {m['failed']} failed, the first: {m['first_error']}"
              for name, m in results.items() if not m.get("error") and m.get("first_error")]
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], args: argparse.Namespace, path: str) -> None:
    """Output tokens/s (with requests/s) per server beside the latency percentiles per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = {name: m for name, m in results.items() if not m.get("error")}
    names = list(ok)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (tput, lat) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 2.6]})
    bars = tput.bar(names, [ok[n]["output_throughput"] for n in names], color=colors[:len(names)])
    tput.bar_label(bars, labels=[f"{ok[n]['output_throughput']:.1f} tok/s\n{ok[n]['request_throughput']:.2f} req/s"
                                 for n in names], fontsize=8)
    tput.set_ylabel("output tokens/s")
    tput.set_title("Throughput")
    tput.margins(y=0.2)
    x = np.arange(len(LATENCIES))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        values = [ok[name][f"{stat}_{metric}_ms"] for metric, stat, _ in LATENCIES]
        lat.bar(x + (i - (len(names) - 1) / 2) * width, values, width, label=name, color=colors[i % len(colors)])
    lat.set_xticks(x, [label for _, _, label in LATENCIES])
    lat.set_ylabel("ms")
    lat.set_title("Latency percentiles (lower is better)")
    every = [v for n in names for metric, stat, _ in LATENCIES if (v := ok[n][f"{stat}_{metric}_ms"]) > 0]
    if every and max(every) / min(every) > 30:  # TTFT can dwarf ITL: a log scale keeps both readable
        lat.set_yscale("log")
    lat.legend()
    concurrency = args.max_concurrency or "unbounded"
    fig.suptitle(f"{args.num_prompts} requests, {args.input_len} prompt / {args.output_len} output tokens, "
                 f"concurrency {concurrency}, rate {args.request_rate}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclasses.dataclass(slots=True)
class LaunchedServer:
    url: str
    ready_s: float  # from the launch to the first 200 from /health
    proc: subprocess.Popen | None = None

    def peak_rss_bytes(self) -> int:
        """The server's processes' peak resident sets so far (VmHWM, summed over the process
        and its children: an upper bound on the tree's peak). 0 where /proc cannot say."""
        import psutil

        total = 0
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except (AttributeError, psutil.Error):
            return 0
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
            except OSError:
                continue
        return total


@contextlib.contextmanager
def launched_server(name: str, cmd_for_port: Callable[[int], list[str]], timeout: float,
                    env: dict[str, str] | None = None) -> Iterator[LaunchedServer]:
    """Run `cmd_for_port(port)` on a free local port until the block ends, once its /health
    answers 200. Its output goes to a log file, kept (and quoted) when it fails to start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = cmd_for_port(port)
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
    print(f"Starting {shlex.join(cmd)} (log: {log.name})", file=sys.stderr, flush=True)
    start = time.monotonic()
    url = f"http://127.0.0.1:{port}"
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=None if env is None else envs.child_env(**env))
    except BaseException:
        log.close()
        os.unlink(log.name)
        raise
    try:
        wait_healthy(name, proc, url, log.name, timeout)
        yield LaunchedServer(url, time.monotonic() - start, proc)
    finally:
        stop_process(proc, timeout=30)
        log.close()
    os.unlink(log.name)  # kept when the start or the run failed


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM (a server's graceful shutdown), then SIGKILL if it has not exited in `timeout` s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def pagedllm_serve_cmd(model: str, server_args: str) -> Callable[[int], list[str]]:
    return lambda port: [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", model, "--host",
                         "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning", *shlex.split(server_args)]


@contextlib.contextmanager
def _pagedllm_server(args: argparse.Namespace) -> Iterator[str | None]:
    """`pagedllm serve --model` on a free local port for the run (its URL), or None without --model."""
    if not args.model:
        yield None
        return
    with launched_server("pagedllm-serve", pagedllm_serve_cmd(args.model, args.server_args),
                         args.server_timeout) as server:
        yield server.url


def wait_healthy(name: str, proc: subprocess.Popen, url: str, log_path: str, timeout: float) -> None:
    """Poll `url`/health until it answers 200. ValueError with the log's tail if the process
    exits first, or after `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    # One client for every poll: httpx.get builds a client (and its TLS context, ~10-40 ms of
    # CPU) per call, which every 50 ms would take a share of the CPU the server starts on.
    with httpx.Client(timeout=2) as client:
        while True:
            if proc.poll() is not None:
                with open(log_path, encoding="utf-8", errors="replace") as f:
                    tail = f.read()[-3000:]
                raise ValueError(f"{name} exited with {proc.returncode} before it was ready:\n{tail}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise ValueError(f"{name} was not ready after {timeout:.0f} s; its log: {log_path}")
            time.sleep(0.05)
