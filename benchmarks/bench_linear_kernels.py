"""Microbenchmark of the CPU linear kernels for Gemma 3 270M's shapes: bf16 F.linear, bf16 with
the weight pre-packed for oneDNN (what every float linear runs), weight-only int8 / int4 through
torch's kernels and through pagedllm's (pagedllm/csrc/, "pl int8" / "pl int4"), and W8A8
(per-row dynamic int8 activations, what the quantized LM head runs above 8 rows).

Two views, since they disagree: one weight timed over and over (it stays in cache, which
flatters small shapes), and a decode-like pass over 18 layers' worth of weights (streamed from
memory, as in a real forward pass). Numbers in docs/performance.md.

    python benchmarks/bench_linear_kernels.py [--rows 1,4,8,64]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers.cpu_gemm import onednn_has_bf16, pack_weight, packed_linear
from pagedllm.model_executor.layers.quantization import DynamicInt8Quant, quantize_int4, quantize_int8

DECODER_SHAPES = {"qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048)}
LM_HEAD = (262144, 640)
NUM_LAYERS = 18
# What the float linears run in: bf16 where oneDNN has a bf16 GEMM, else float32 (AVX2-only CPUs).
ACT = torch.bfloat16 if onednn_has_bf16() else torch.float32


def median_ms(fn: Callable[..., object], *args: object, reps: int = 20) -> float:
    fn(*args)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def _int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, q, scale.to(x.dtype))


def _int4(x: torch.Tensor, packed: torch.Tensor, group: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros.to(x.dtype))


def formats(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> x ↦ x @ w.T in that weight format (activations in x's dtype, ACT)."""
    q8, s8 = quantize_int8(w)
    name = "bf16" if ACT == torch.bfloat16 else "fp32"
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        name: partial(F.linear, weight=w.to(ACT)),
        f"{name} packed": partial(packed_linear, packed=pack_weight(w.to(ACT)), bias=None),
        "int8": partial(_int8, q=q8, scale=s8),
        "w8a8": DynamicInt8Quant(w),
    }
    for g in (32, 128):
        q4, sz = quantize_int4(w, g)
        p4 = torch._convert_weight_to_int4pack_for_cpu(q4, 1)
        fns[f"int4 g{g}"] = partial(_int4, packed=p4, group=g, scales_and_zeros=sz)
    if cpu_kernels.kernels() is not None:
        fns["pl int8"] = partial(cpu_kernels.w8a16_linear, qweight=q8, scales=s8, bias=None)
        q4, sz = quantize_int4(w, 128)
        p4, s4 = cpu_kernels.pack_int4(q4, sz)
        fns["pl int4 g128"] = partial(cpu_kernels.w4a16_linear, packed=p4, scales_zeros=s4, group_size=128, bias=None)
    return fns


def per_shape(rows: list[int]) -> None:
    print("one weight, timed repeatedly (cache-hot for the decoder shapes), ms")
    for name, (n, k) in {**DECODER_SHAPES, "lm_head": LM_HEAD}.items():
        w = torch.randn(n, k) * 0.02
        fns = formats(w)
        for m in rows:
            reps = 100 if n < 10000 else 5
            x = torch.randn(m, k)
            xb = x.to(ACT)
            cells = [f"{f}: {median_ms(fn, xb, reps=reps):.3f}" for f, fn in fns.items()]
            cells.append(f"fp32 F.linear: {median_ms(F.linear, x, w, reps=reps):.3f}")
            cells.append(f"int8 fp32-act: {median_ms(fns['int8'], x, reps=max(reps // 10, 2)):.3f}")
            print(f"  {name:8s} rows {m:3d} | " + " | ".join(cells), flush=True)


def _step(layers: list[dict[str, dict]], xs: dict[str, torch.Tensor], fmt: str) -> None:
    for layer in layers:
        for name, fns in layer.items():
            fns[fmt](xs[name])


def decode_stack(rows: list[int]) -> None:
    print(f"decode-like: {NUM_LAYERS} layers x {list(DECODER_SHAPES)}, weights streamed, ms per step")
    layers = [{name: formats(torch.randn(n, k) * 0.02) for name, (n, k) in DECODER_SHAPES.items()}
              for _ in range(NUM_LAYERS)]
    for m in rows:
        xs = {name: torch.randn(m, k).to(ACT) for name, (_, k) in DECODER_SHAPES.items()}
        cells = [f"{fmt}: {median_ms(_step, layers, xs, fmt):.2f}" for fmt in layers[0]["qkv"]]
        print(f"  rows {m:3d} | " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,64", help="comma-separated row counts")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    decode_stack(rows)
    per_shape(rows)


if __name__ == "__main__":
    main()
