"""Microbenchmark of the GGUF kernels (pagedllm/csrc/gguf.c, `gguf_ops.gguf_linear`) against
pagedllm's int8 weight-only GEMV (`cpu_kernels.w8a16_linear`) on the same shapes.

At one row a linear is bound by memory bandwidth, so the figure that matters is GB/s of weight
bytes streamed; each call takes the next of several copies of the weight, together well past
the L3, so the weight comes from memory as in a real forward pass (`--in-cache`: one copy, over
and over). At 64 rows the arithmetic sets the time (ms per call). `--repacked` also times the
types the loader repacks 8 rows at a time (csrc/gguf_x8.c) in that layout ("Q5_0 x8").

    python benchmarks/bench_gguf_kernels.py [--rows 1,8,64] [--types Q4_K,Q6_K,Q8_0,Q5_0] [--shape 4096x4096]
        [--repacked] [--in-cache] [--threads N] [--no-head]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import gguf
import numpy as np
import torch

from pagedllm.model_executor.layers import cpu_kernels, gguf_ops
from pagedllm.model_executor.layers.quantization import quantize_int8

SHAPE = (4096, 4096)
# Gemma 3 1B's LM head: 262144 x 1152. 1152 is not a whole number of 256-value super-blocks, so
# a GGUF cannot hold it as Q6_K (llama.cpp's quantizer falls back to Q8_0 there); Q6_K is timed
# on the nearest shape that can be, 262144 x 1280, and Q8_0 on the real one.
LM_HEAD = {"Q6_K": (262144, 1280), "Q8_0": (262144, 1152)}
STREAM_BYTES = 160 << 20  # the copies a timing cycles through: well past a 32 MiB L3


def random_weight(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A valid GGUF weight [n, row bytes]: random quants, sane float16 scales."""
    block, size = gguf_ops.GGUF_TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in gguf_ops.SCALE_FIELDS[qtype]:
        scales = rng.uniform(0.002, 0.02, (n, k // block)).astype(np.float16)
        raw[..., off : off + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def time_cycling(fn: Callable[[int], object], copies: int, reps: int) -> tuple[float, float]:
    """(median, best) seconds of fn(i), i cycling over the copies (one warm-up pass first). The
    best is what the kernel does when nothing else holds a core: on a shared machine a thread of
    the team waiting out another process's time slice sets the median."""
    for i in range(copies):
        fn(i)
    times = []
    for r in range(reps):
        t = time.perf_counter()
        fn(r % copies)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2], times[0]


def bench_shape(name: str, n: int, k: int, types: list[str], rows: list[int], reps: int, repacked: bool = False,
                in_cache: bool = False) -> None:
    torch.manual_seed(0)
    print(f"\n{name}: {n} x {k}, {torch.get_num_threads()} threads")
    print(f"{'format':>9} {'rows':>5} {'MB':>8} {'us/call':>10} {'GB/s':>7} {'best us':>10} {'best GB/s':>9}")
    w = torch.randn(min(n, 16384), k) * 0.02
    q8, s8 = quantize_int8(w)
    if n > q8.shape[0]:  # the LM head: the int8 rows repeated (values do not change the timing)
        q8, s8 = q8.repeat(n // q8.shape[0], 1), s8.repeat(n // s8.shape[0])
    formats: list[tuple[str, int, Callable[[torch.Tensor, torch.Tensor], object], list[torch.Tensor]]] = []
    for t in types:
        qtype = int(gguf.GGMLQuantizationType[t])
        first = random_weight(qtype, n, k)
        copies = [first] + [first.clone() for _ in range(0 if in_cache else STREAM_BYTES // first.numel())]
        formats.append((t, first.numel(), lambda x, wt, q=qtype: gguf_ops.gguf_linear(x, q, wt, k), copies))
        if repacked and gguf_ops.can_repack(qtype, first):
            def run_x8(x, wt, q=qtype):
                return gguf_ops.gguf_linear(x, q, wt, k, repacked=True)

            formats.append((f"{t} x8", first.numel(), run_x8, [gguf_ops.repack(qtype, c, k) for c in copies]))
    copies8 = [q8] + [q8.clone() for _ in range(0 if in_cache else STREAM_BYTES // q8.numel())]
    formats.append(("int8", q8.numel() + 2 * n, lambda x, wt: cpu_kernels.w8a16_linear(x, wt, s8, None), copies8))
    for m in rows:
        x = torch.randn(m, k)
        for label, nbytes, fn, copies in formats:
            med, best = time_cycling(lambda i, fn=fn, copies=copies, x=x: fn(x, copies[i]), len(copies),
                                     reps if m * n * k < 2**31 else max(3, reps // 10))
            print(f"{label:>9} {m:>5} {nbytes / 1e6:>8.1f} {med * 1e6:>10.0f} {nbytes / med / 1e9:>7.1f} "
                  f"{best * 1e6:>10.0f} {nbytes / best / 1e9:>9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q5_0")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=0, help="torch's thread count (default: as set)")
    parser.add_argument("--no-head", action="store_true", help="skip the LM head shapes")
    parser.add_argument("--shape", default="x".join(map(str, SHAPE)), help="the decoder weight, N x K")
    parser.add_argument("--repacked", action="store_true", help="also the repacked layout, where a type has one")
    parser.add_argument("--in-cache", action="store_true", help="one copy of each weight: in cache after the first")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_kernels.kernels() is None:
        raise SystemExit("pagedllm's C kernels are not built here (no gcc, or PAGEDLLM_CPU_KERNELS=0)")
    print(f"kernels: {cpu_kernels.describe(cpu_kernels.loaded_isa())}")
    rows = [int(r) for r in args.rows.split(",")]
    n, k = (int(v) for v in args.shape.split("x"))
    bench_shape("decoder", n, k, args.types.split(","), rows, args.reps, args.repacked, args.in_cache)
    if not args.no_head:
        for qtype, (n, k) in LM_HEAD.items():
            bench_shape("LM head", n, k, [qtype], rows, args.reps, args.repacked, args.in_cache)


if __name__ == "__main__":
    main()
