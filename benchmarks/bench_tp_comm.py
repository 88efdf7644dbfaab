"""What tensor parallelism's collectives cost per step on this machine: two gloo ranks (as `-tp 2`
runs them) time the all-reduce of `[tokens, hidden]` (two per decoder layer plus one for the
embedding) and the all-gather of each rank's logit slice `[rows, vocab / 2]`, for Gemma 3 270M's
shapes by default. Prints milliseconds per collective, the bytes each moves, and the total per
step, to set against the step time from `pagedllm bench latency`. Numbers in docs/performance.md.

    python benchmarks/bench_tp_comm.py [--hidden 640 --layers 18 --vocab 262144 --dtype float32]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def _rank(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for tokens in (1, 8, 64, 512):
        x = torch.randn(tokens, args.hidden, dtype=dtype)
        ms = _time(lambda x=x: dist.all_reduce(x), args.iters)
        rows.append(("all_reduce", tokens, tokens * args.hidden * itemsize, ms, 2 * args.layers + 1))
    for sampled in (1, 8, 64):
        part = torch.randn(sampled, args.vocab // 2, dtype=dtype)
        out = [torch.empty_like(part) for _ in range(2)]
        ms = _time(lambda p=part, o=out: dist.all_gather(o, p), max(3, args.iters // 10))
        rows.append(("all_gather", sampled, sampled * args.vocab // 2 * itemsize, ms, 1))
    if rank == 0:
        print(f"{'collective':<11}{'rows':>6}{'bytes/rank':>12}{'ms each':>10}{'per step':>9}{'ms/step':>9}")
        for name, n, nbytes, ms, count in rows:
            print(f"{name:<11}{n:>6}{nbytes:>12,}{ms:>10.3f}{count:>9}{ms * count:>9.2f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(_free_port(), args), nprocs=2)


if __name__ == "__main__":
    main()
