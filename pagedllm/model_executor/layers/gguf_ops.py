"""GGUF weights used as they lie in the file: linear layers and embedding lookups that read a
tensor's quantized blocks directly (csrc/gguf.c), so the engine can memory-map a GGUF file and
run it with no float copy of its weights (a Q4_K_M model stays ~4.5 bits a weight in memory,
and decode streams that, not 16 bits).

A weight is a uint8 tensor [n, row bytes]: row j holds k values as k / block_size blocks of
the type's layout (`GGUF_TYPES`). It may be a read-only memory map: only its data pointer is
read. The kernels quantize activations to int8 per 32 values and run integer dot products;
where they are not built (no gcc, PAGEDLLM_CPU_KERNELS=0) or a tensor is not on the CPU, the
same calls dequantize with gguf-py and run torch (slow, but the same results within the
activations' int8 rounding).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from pagedllm import cpu_isa
from pagedllm.model_executor.layers import cpu_kernels

_T = gguf.GGMLQuantizationType
# ggml type id -> (values per block, bytes per block), for the types the kernels read.
GGUF_TYPES: dict[int, tuple[int, int]] = {
    int(t): tuple(gguf.GGML_QUANT_SIZES[t])
    for t in (_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K)
}
FLOAT_TYPES = frozenset({int(_T.F32), int(_T.F16), int(_T.BF16)})
# Byte offsets of each block's float16 scale fields (d, then m / dmin where the type has one):
# the only bytes of a block that can hold inf or NaN. Tests and benchmarks fill blocks with
# random bytes and these with sane scales.
SCALE_FIELDS: dict[int, tuple[int, ...]] = {
    int(_T.Q4_0): (0,), int(_T.Q4_1): (0, 2), int(_T.Q5_0): (0,), int(_T.Q5_1): (0, 2), int(_T.Q8_0): (0,),
    int(_T.Q4_K): (0, 2), int(_T.Q5_K): (0, 2), int(_T.Q6_K): (208,),
}


_FLOAT = (torch.float32, torch.bfloat16)  # the activation and output dtypes the kernels take
# Weights repacked 8 rows side by side (csrc/gguf_x8.c), for decode's few rows: the flag on the
# type id that tells the kernels a weight is, and per type a unit's bytes: one block (a K
# super-block, a legacy block of 32) of 8 rows.
_X8_ENUM = cpu_kernels.c_enum("gguf_blocks.h", "GG_X8")
_X8 = _X8_ENUM["GG_X8"]
_X8_UNIT_BYTES = {int(t): _X8_ENUM[f"GG_X8_{t.name}_UNIT"] for t in (_T.Q4_K, _T.Q6_K, _T.Q5_0, _T.Q4_0)}
REPACK_TYPES = frozenset(_X8_UNIT_BYTES)


def repacked_row_bytes(qtype: int, k: int) -> int:
    """The bytes of a row of k values in `repack`'s layout."""
    return k // GGUF_TYPES[qtype][0] * _X8_UNIT_BYTES[qtype] // 8


def _layout(qtype: int, weight: torch.Tensor, k: int, repacked: bool = False) -> tuple[int, int]:
    """(n, row stride in bytes) of a GGUF weight holding k values a row (`repacked`: `repack`'s
    output). The kernel reads the rows through a raw pointer, so a shape that does not hold them
    fails here, not in C."""
    if qtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type {qtype} is not supported (supported: {sorted(GGUF_TYPES)})")
    block, size = GGUF_TYPES[qtype]
    if k <= 0 or k % block or (qtype not in FLOAT_TYPES and k % 32):
        raise ValueError(f"GGUF type {qtype}: k = {k} is not a whole number of {block}-value blocks")
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"GGUF weight must be a uint8 [n, row bytes] tensor with unit inner stride, not "
                         f"{weight.dtype} {tuple(weight.shape)} strides {weight.stride()}")
    if weight.shape[1] < k // block * size:
        raise ValueError(f"GGUF weight rows hold {weight.shape[1]} bytes; {k} values of type {qtype} take "
                         f"{k // block * size}")
    if repacked and (qtype not in REPACK_TYPES or weight.shape[0] % 8 or not weight.is_contiguous()
                     or weight.shape[1] != repacked_row_bytes(qtype, k)):
        raise ValueError(f"GGUF type {qtype}: {tuple(weight.shape)} is not a repacked weight of {k} values a row")
    return weight.shape[0], weight.stride(0)


def _dequantize_numpy(qtype: int, weight: torch.Tensor, k: int, rows: torch.Tensor | None) -> torch.Tensor:
    """gguf-py's float32 dequantize of the rows: the fallback where the kernels cannot run."""
    block, size = GGUF_TYPES[qtype]
    w = weight.detach().cpu()
    if rows is not None:
        w = w[rows.cpu()]
    data = np.ascontiguousarray(w.numpy()[:, : k // block * size])
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, _T(qtype)), dtype=np.float32).reshape(-1, k))


def _on_kernels(*tensors: torch.Tensor | None) -> bool:
    """Whether the C kernels can take these tensors: built, and all on the CPU."""
    return cpu_kernels.kernels() is not None and all(t is None or t.is_cpu for t in tensors)


def gguf_linear(x: torch.Tensor, qtype: int, weight: torch.Tensor, k: int, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, repacked: bool = False) -> torch.Tensor:
    """x [.., k] (float32 or bf16) @ W^T (+ bias) for a GGUF weight W [n, row bytes]: [.., n] in
    x's dtype. `out`: a 2-D [rows, n] view to write instead (its own dtype, unit inner stride;
    it may be a column slice of a wider tensor, as a q/k/v segment of one projection's output),
    which is returned. `repacked`: W is `repack`'s. A row's result does not depend on the other
    rows in x, nor on whether W is repacked."""
    n, _ = _layout(qtype, weight, k, repacked)
    if x.shape[-1] != k:
        raise ValueError(f"gguf_linear: x has {x.shape[-1]} features, the weight {k}")
    lead = x.shape[:-1]
    m = x.numel() // k
    if out is not None and (out.dim() != 2 or tuple(out.shape) != (m, n) or (m > 0 and n > 1 and out.stride(1) != 1)):
        raise ValueError(f"gguf_linear: out must be [{m}, {n}] with unit inner stride, not {tuple(out.shape)}")
    if not (_on_kernels(x, weight, bias, out) and x.dtype in _FLOAT and (out is None or out.dtype in _FLOAT)):
        if repacked:
            raise ValueError("gguf_linear: a repacked weight runs on the CPU kernels, float32 or bf16 in and out")
        y = F.linear(x.reshape(m, k).float(), _dequantize_numpy(qtype, weight, k, None).to(x.device),
                     None if bias is None else bias.float())
        if out is not None:
            return out.copy_(y)
        return y.to(x.dtype).view(*lead, n)
    x2 = cpu_kernels._rows(x, k)
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype)
    if m > 0:
        _bind(x2, qtype, weight, k, cpu_kernels._as(bias, y.dtype), y, torch.get_num_threads(), True, repacked)
    return y if out is not None or x.dim() == 2 else y.view(*lead, n)


def bind_gguf_linear(x: torch.Tensor, qtype: int, weight: torch.Tensor, k: int, bias: torch.Tensor | None,
                     y: torch.Tensor, nthreads: int, now: bool = False,
                     repacked: bool = False) -> cpu_kernels.Call | None:
    """`gguf_linear` laid out once for a decode plan to replay: x [m, k] contiguous, y [m, n]
    with unit inner stride (its row stride passed: a column slice of a wider output works),
    bias [n] contiguous in y's dtype or None."""
    n, _ = _layout(qtype, weight, k, repacked)
    if x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
        raise ValueError(f"bind_gguf_linear: x must be contiguous [m, {k}], not {tuple(x.shape)}")
    if y.dim() != 2 or tuple(y.shape) != (x.shape[0], n) or (n > 1 and y.stride(1) != 1):
        raise ValueError(f"bind_gguf_linear: y must be [{x.shape[0]}, {n}] with unit inner stride")
    if bias is not None and (bias.dtype != y.dtype or not bias.is_contiguous() or bias.numel() != n):
        raise ValueError(f"bind_gguf_linear: bias must be [{n}] contiguous in y's dtype")
    return _bind(x, qtype, weight, k, bias, y, nthreads, now, repacked)


def _bind(x: torch.Tensor, qtype: int, weight: torch.Tensor, k: int, bias: torch.Tensor | None, y: torch.Tensor,
          nthreads: int, now: bool, repacked: bool = False) -> cpu_kernels.Call | None:
    args = (qtype | (_X8 if repacked else 0), weight.data_ptr(), weight.stride(0), weight.shape[0], k, x.data_ptr(),
            cpu_kernels._is_bf16(x), x.shape[0], cpu_kernels._ptr(bias), y.data_ptr(), cpu_kernels._is_bf16(y),
            y.stride(0), nthreads)
    return cpu_kernels._bound(cpu_kernels.kernels().pl_gguf_linear, args, now, x, weight, bias, y)


def gguf_dequantize(qtype: int, weight: torch.Tensor, k: int, rows: torch.Tensor | list[int] | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rows `rows` of a GGUF weight (all rows when None) as float: [len(rows) or n, k] in
    `dtype`. The embedding lookup (a few rows of a quantized table) and a whole-matrix
    dequantize; float32 values equal gguf-py's dequantize exactly, bf16 ones are those rounded."""
    n, row_bytes = _layout(qtype, weight, k)
    if rows is not None:
        rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1).cpu().contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise IndexError(f"gguf_dequantize: rows out of range for {n} rows")
    count = n if rows is None else rows.numel()
    if not (_on_kernels(weight) and dtype in (torch.float32, torch.bfloat16)):
        return _dequantize_numpy(qtype, weight, k, rows).to(device=weight.device, dtype=dtype)
    out = torch.empty((count, k), dtype=dtype)
    if count:
        cpu_kernels.kernels().pl_gguf_dequantize(qtype, weight.data_ptr(), row_bytes, k, cpu_kernels._ptr(rows),
                                                 count, out.data_ptr(), int(dtype == torch.bfloat16), k,
                                                 torch.get_num_threads())
    return out


def gguf_rescore(qtype: int, weight: torch.Tensor, k: int, logits: torch.Tensor, idx: torch.Tensor,
                 hidden: torch.Tensor) -> bool:
    """In place: logits[r, idx[r, j]] = hidden[r] . row idx[r, j] of the weight, dequantized in
    hidden's dtype, as `gguf_dequantize` gives it (an LM head's candidates re-scored from its own
    blocks, with no [rows, candidates, k] gather). False, with nothing done, where the kernels
    cannot take these tensors."""
    if not (_on_kernels(weight) and hidden.dtype in (torch.float32, torch.bfloat16)
            and logits.dtype in (torch.float32, torch.bfloat16) and logits.is_contiguous()
            and idx.dtype == torch.int64 and idx.dim() == 2 and idx.shape[0] == hidden.shape[0] == logits.shape[0]):
        return False
    _, row_bytes = _layout(qtype, weight, k)
    hidden, idx = hidden.contiguous(), idx.contiguous()
    cpu_kernels.kernels().pl_gguf_rescore(qtype, weight.data_ptr(), row_bytes, k, hidden.data_ptr(),
                                          cpu_kernels._is_bf16(hidden), hidden.shape[0], idx.data_ptr(), idx.shape[1],
                                          logits.data_ptr(), cpu_kernels._is_bf16(logits), logits.shape[1],
                                          torch.get_num_threads())
    return True


def can_repack(qtype: int, weight: torch.Tensor) -> bool:
    """Whether `repack` takes this weight: a Q4_K / Q6_K / Q5_0 / Q4_0 tensor of whole groups of 8
    rows, on the CPU, with the kernels built."""
    return qtype in REPACK_TYPES and weight.dim() == 2 and weight.shape[0] % 8 == 0 and _on_kernels(weight)


def repack_pays() -> bool:
    """Whether the kernels run repacked weights with SIMD (AVX2, AVX-512); the portable build
    reads each group back in the file's layout first, which only costs."""
    return cpu_kernels.kernels() is not None and cpu_isa.selected() in ("avx2", "avx512")


def repack(qtype: int, weight: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """W's rows repacked 8 at a time (csrc/gguf_x8.c), for `gguf_linear(..., repacked=True)`:
    a contiguous uint8 tensor [n, repacked_row_bytes(qtype, k)] (into `out` where given)."""
    n, row_bytes = _layout(qtype, weight, k)
    if not can_repack(qtype, weight):
        raise ValueError(f"GGUF type {qtype}, {n} rows: not a weight the kernels repack")
    shape = (n, repacked_row_bytes(qtype, k))
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8)
    elif tuple(out.shape) != shape or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"repack: out must be a contiguous uint8 {shape}")
    cpu_kernels.kernels().pl_gguf_repack(qtype, weight.data_ptr(), row_bytes, n, k, out.data_ptr(),
                                         torch.get_num_threads())
    return out
