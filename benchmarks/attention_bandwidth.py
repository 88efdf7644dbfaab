"""The Triton paged-attention kernel's achieved memory bandwidth on a decode batch, against the
device's own copy bandwidth: K/V bytes read per call / time per call. Llama-3.1-8B's attention
shape (32 query heads, 8 KV heads, head_dim 128, bf16 queries, blocks of 16, shuffled over the
cache), for each `--kv-cache-dtype` (a byte cache reads its bytes and a float32 scale per 32) and
each split-KV count (`--kv-splits`; 0: the kernel's own choice, 1: no split).
`python benchmarks/attention_bandwidth.py [--cases 64x4096] [--kv-cache-dtype auto fp8] [--kv-splits 0 1 4]` (CUDA)."""

from __future__ import annotations

import argparse
import json
import math

import torch


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 31) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms / 1e3)


def _time_ms(fn, iters: int = 20, graph: bool = False) -> float:
    """Milliseconds per call. `graph`: the calls replayed from one CUDA graph, as a decode step
    runs them (the time of the kernels, without Python's launch overhead)."""
    for _ in range(3):
        fn()
    run, calls_per_run = fn, 1
    if graph:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        run, calls_per_run, iters = g.replay, iters, 5
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (iters * calls_per_run)


def measure(batch: int, context: int, kv: str = "auto", splits: int = 0, num_heads=32, num_kv_heads=8,
            head_dim=128, block_size=16) -> dict:
    from pagedllm.model_executor.layers import kv_quant
    from pagedllm.model_executor.layers.triton_ops.paged_attention import block_q_for, unified_attention
    from pagedllm.model_executor.layers.triton_ops.split_kv import num_kv_splits

    device = torch.device("cuda")
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    quant = kv_quant.kv_quant_for(kv)
    k_cache, v_cache = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(2))
    scales = element = None
    if quant is not None:  # the bytes and group scales kv_quant stores
        (k_cache, k_scales), (v_cache, v_scales) = (kv_quant.quantize(x, quant) for x in (k_cache, v_cache))
        scales, element = (k_scales, v_scales), quant.element
    tables = torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq].view(batch, -1).int() + 1
    q = torch.randn(batch, num_heads, head_dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    splits = splits or num_kv_splits(batch, num_kv_heads, 1, block_q_for(1, num_heads // num_kv_heads), device)
    ms = _time_ms(lambda: unified_attention(q, k_cache, v_cache, out, tables, seq_lens, qsl, 1,
                                            1 / math.sqrt(head_dim), None, None, scales, element, splits),
                  graph=True)
    kv_bytes = 2 * batch * context * num_kv_heads * kv_quant.bytes_per_token_head(head_dim, 2, quant)
    return {"kv_cache_dtype": kv, "kv_splits": splits, "batch": batch, "context": context, "ms": ms,
            "kv_bytes": kv_bytes, "bytes_per_s": kv_bytes / (ms / 1e3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default="1x4096,16x4096,64x4096,128x2048,256x1024")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"])
    parser.add_argument("--kv-splits", nargs="+", type=int, default=[0])
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    peak = copy_bandwidth(torch.device("cuda"))
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {peak / 1e12:.2f} TB/s (read + write)")
    rows = []
    for kv in args.kv_cache_dtype:
        for case in args.cases.split(","):
            batch, context = (int(x) for x in case.split("x"))
            for splits in args.kv_splits:
                r = measure(batch, context, kv, splits)
                r["share_of_copy_bandwidth"] = r["bytes_per_s"] / peak
                rows.append(r)
                print(f"{kv:8s} batch {batch:4d} x {context:5d} keys, {r['kv_splits']:2d} splits"
                      f"{' (auto)' if not splits else ''}: {r['ms'] * 1e3:8.1f} us, "
                      f"{r['kv_bytes'] / 1e6:8.1f} MB K/V, {r['bytes_per_s'] / 1e12:.2f} TB/s = "
                      f"{100 * r['share_of_copy_bandwidth']:.0f}% of the copy's")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bytes_per_s": peak, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
