"""Integer weights with one float16 scale per 32 inputs, written as GGUF blocks (Q4_0, Q5_0,
Q8_0), so a GPTQ, AWQ or compressed-tensors checkpoint runs on the GGUF kernels (csrc/gguf.c)
with no float copy. The repack is exact: each weight is w = d * v with the checkpoint's own
float16 scale d and integer v (quant minus zero point), and those are what the blocks hold.

- Q4_0: v in [-8, 7], stored as v + 8 (symmetric 4-bit: zero point 8);
- Q5_0: v in [-16, 15], stored as v + 16 (asymmetric 4-bit: quant minus any zero point 0-16);
- Q8_0: v in [-128, 127] (8-bit, symmetric).

Float8 weights (FP8 checkpoints, `--quantization fp8`) go to Q8_0 too (`float_blocks`): each
block of 32 gets the power of two d = 2^(E - 6), E the exponent of its largest magnitude, so
every value within 2^3 of that largest one (3 mantissa bits in e4m3) is an exact integer
multiple of d, |v| <= 120. Smaller values of the block are rounded to a multiple of d.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as _T

Q4_0, Q5_0, Q8_0 = int(_T.Q4_0), int(_T.Q5_0), int(_T.Q8_0)
BLOCK = 32
_RANGES = ((Q4_0, -8, 7), (Q5_0, -16, 15), (Q8_0, -128, 127))


def block_type_for(lo: int, hi: int) -> int:
    """The narrowest block type whose integers cover [lo, hi]."""
    for qtype, low, high in _RANGES:
        if low <= lo and hi <= high:
            return qtype
    raise ValueError(f"quantized values in [{lo}, {hi}] do not fit 8-bit blocks (asymmetric 8-bit is not supported)")


def exact_float16(scales: np.ndarray, what: str) -> np.ndarray:
    """`scales` as float16, which must hold them exactly (the blocks' scale is a float16)."""
    half = scales.astype(np.float16)
    if not np.array_equal(half.astype(np.float32), scales.astype(np.float32)):
        raise ValueError(f"{what}: its scales are not exact in float16, which the repacked blocks need")
    return half


def float_blocks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Float values [N, K] (K a multiple of 32) as (integers [N, K], float16 power-of-two scales
    [N, K / 32], how many values the integers do not hold exactly): w ~ scale * integer."""
    n, k = values.shape
    v = values.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    top = np.abs(v).max(axis=-1)
    if not np.isfinite(top).all():
        raise ValueError("float weights with inf or NaN cannot be blocked")
    exponent = np.frexp(np.where(top > 0, top, 1.0))[1] - 1  # top in [2^E, 2^(E+1))
    # float16 holds scales down to 2^-24: a block under 2^-18 takes that one (its integers stay under 64).
    d = np.ldexp(np.float32(1), np.maximum(exponent - 6, -24)).astype(np.float32)
    q = np.rint(v / d[..., None])
    inexact = int(np.count_nonzero(q * d[..., None] != v))
    return q.astype(np.int16).reshape(n, k), d.astype(np.float16), inexact


def encode_blocks(values: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> tuple[int, np.ndarray]:
    """values: integers [N, K] (K a multiple of 32), scales: float16 [N, K / 32], w = scale * value
    -> (ggml type, uint8 [N, K / 32 * block bytes]) in the narrowest type that holds them, or
    with `out` (uint8 [N, K / 32 * 34]) as Q8_0 written into it."""
    n, k = values.shape
    if k % BLOCK or scales.shape != (n, k // BLOCK) or scales.dtype != np.float16:
        raise ValueError(f"encode_blocks: values {values.shape} and float16 scales [N, K/32] expected, "
                         f"got scales {scales.shape} {scales.dtype}")
    qtype = block_type_for(int(values.min(initial=0)), int(values.max(initial=0)))
    if out is not None:  # Q8_0 whatever the range (block_type_for refused what exceeds it)
        blocks = out.reshape(n, k // BLOCK, 2 + BLOCK)
        blocks[..., :2] = np.ascontiguousarray(scales).view(np.uint8).reshape(n, k // BLOCK, 2)
        blocks[..., 2:] = values.reshape(n, k // BLOCK, BLOCK).astype(np.int8).view(np.uint8)
        return Q8_0, out
    v = values.reshape(n, k // BLOCK, BLOCK)
    d = np.ascontiguousarray(scales).view(np.uint8).reshape(n, k // BLOCK, 2)
    if qtype == Q8_0:
        parts = [d, v.astype(np.int8).view(np.uint8)]
    else:
        u = (v + (8 if qtype == Q4_0 else 16)).astype(np.uint8)
        qs = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)  # byte j: value j, then value j + 16
        if qtype == Q4_0:
            parts = [d, qs]
        else:  # bit j of qh: value j's fifth bit
            high = (u >> 4).astype(np.uint32) << np.arange(BLOCK, dtype=np.uint32)
            qh = np.bitwise_or.reduce(high, axis=-1).astype("<u4").view(np.uint8).reshape(n, k // BLOCK, 4)
            parts = [d, qh, qs]
    return qtype, np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(n, -1))
