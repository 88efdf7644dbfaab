"""pagedllm's CPU decode attention over each KV cache dtype: ms per call and the cache bytes it
reads per second, for a decode batch over shuffled blocks. Shapes: the default model's attention
(Gemma 3 270M: 4 query heads on one 256-wide kv head) and Llama 3.2 1B's (32 on 8, 64 wide).

    python benchmarks/bench_kv_cache_dtype.py [--seqs 16] [--context 2048] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.model_executor.layers import cpu_kernels, kv_quant

SHAPES = {"gemma3-270m": (4, 1, 256), "llama-3.2-1b": (32, 8, 64)}
BLOCK = 16


def time_call(hq: int, hk: int, d: int, seqs: int, context: int, kv_cache_dtype: str, dtype: torch.dtype,
              iters: int = 20) -> tuple[float, int]:
    """(seconds per call, cache bytes the call reads)."""
    g = torch.Generator().manual_seed(0)
    blocks = seqs * context // BLOCK
    quant = kv_quant.kv_quant_for(kv_cache_dtype)
    q = torch.randn(seqs, hq, d, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g).view(seqs, -1).contiguous()
    lens = torch.full((seqs,), context, dtype=torch.int64)
    k, v = (torch.randn(blocks, BLOCK, hk, d, generator=g) for _ in range(2))
    if quant is None:
        k_cache, v_cache, scales = k.to(dtype), v.to(dtype), None
    else:
        (k_cache, k_scales), (v_cache, v_scales) = kv_quant.quantize(k, quant), kv_quant.quantize(v, quant)
        scales = (k_scales.contiguous(), v_scales.contiguous(), quant.kind)
    for _ in range(3):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, None, 0.1, scales)
    start = time.perf_counter()
    for _ in range(iters):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, None, 0.1, scales)
    per_call = (time.perf_counter() - start) / iters
    return per_call, 2 * seqs * context * hk * kv_quant.bytes_per_token_head(d, dtype.itemsize, quant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    if cpu_kernels.kernels() is None:
        raise SystemExit("the C kernels are not built here")
    dtype = getattr(torch, args.dtype)
    print(f"{args.seqs} sequences x {args.context} tokens, queries in {args.dtype}, "
          f"{cpu_kernels.describe(cpu_kernels.loaded_isa())}, {torch.get_num_threads()} threads")
    print("| shape | kv_cache_dtype | ms per call | cache GB/s |\n| --- | --- | --- | --- |")
    for name, (hq, hk, d) in SHAPES.items():
        for kv in ("auto", "int8", "fp8_e4m3", "fp8_e5m2"):
            seconds, nbytes = time_call(hq, hk, d, args.seqs, args.context, kv, dtype)
            print(f"| {name} | {kv} | {seconds * 1e3:.2f} | {nbytes / seconds / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
