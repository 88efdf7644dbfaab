"""Weight-only int8 / int4 copies of weights, for few-row (decode) GEMMs on CPU.

Per-output-channel symmetric int8 and group-wise asymmetric int4 stream 2-4x fewer bytes
than a bf16 GEMV, which is what batch-1 decode is bound by. pagedllm's C kernels
(`cpu_kernels.py`; VNNI dot products on activations quantized to ~15 bits per row) run them
near memory bandwidth; without those kernels, PyTorch's `torch._weight_int8pack_mm` and
`torch._weight_int4pack_mm_for_cpu` do, ~2x slower. Both are GEMV-shaped loops,
though: their cost grows linearly with the number of rows, and above a few rows bf16
`F.linear` (a real GEMM) is faster. So a quantized layer keeps its float weight too and
picks by row count (`max_rows`).

Activations go to the kernels in bf16 whatever the model dtype: their float32 paths are
10-60x slower on an AVX-512 bf16 CPU (see docs/performance.md; CPUs without native bf16 are
unmeasured).

The LM head, 63% of the FLOPs, also gets `DynamicInt8Quant`: int8 activations too, quantized
per row on the fly, through oneDNN's u8 x s8 GEMM (VNNI), which is 1.6x faster than the bf16
GEMM at 64 rows and 1.5x faster than `_weight_int8pack_mm` at one.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm import cpu_isa
from pagedllm.cpu_malloc import release_freed_memory
from pagedllm.forward_context import get_exact_logit_rows
from pagedllm.model_executor.custom_op import platform_of
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers.cpu_gemm import onednn_has_bf16
from pagedllm.model_executor.layers.sampler import top_k_indices

INT4_GROUP_SIZES = (128, 64, 32)  # the kernel takes 32, 64, 128 or 256; the largest that fits is fastest
_INT4_ROW_MULTIPLE = 16  # the int4 packing wants out_features % 16 == 0
# Big weights (the LM head) are quantized in slices to bound temporaries; a multiple of the
# packing's 64-row blocks, so slices pack exactly as the whole weight does.
_CHUNK_BYTES = 16 << 20  # float32 bytes of a weight quantized at once: bounds the temporaries (int4: ~6x)
_KERNEL_DTYPE = torch.bfloat16
_PACK_ROWS_HINT = 64  # rows oneDNN tunes its packed int8 layout for; any count runs
_MAX_KERNEL_K = 65536  # the C kernels' int32 accumulators are sized for inputs up to this
# torch's int8 GEMV reads the inputs a vector (8 or 16) at a time with no tail: for other
# widths it reads past the rows (a crash or garbage), so its weights get zero columns up to this.
_TORCH_INT8_K_MULTIPLE = 16


def dynamic_runs_kernel() -> bool:
    """Whether DynamicInt8Quant runs the C u8 x s8 kernel (`cpu_kernels.u8s8_rank`) instead of
    oneDNN's u8 x s8 GEMM: where there is no VNNI, and the kernels are built. For the 262144 x
    640 head on an AVX2 EPYC, oneDNN without VNNI took 31-150 ms at 16 rows and 169 at 64; the
    C kernel 30 and 129 (2026-11-27; 37 and 156 with int16 activations)."""
    return not cpu_isa.has_vnni() and cpu_kernels.kernels() is not None


def chunk_rows(in_features: int) -> int:
    """Rows of a [*, in_features] weight quantized at once: `_CHUNK_BYTES` of float32, in whole
    multiples of 64 rows (the int4 packing's tiles)."""
    return max(64, _CHUNK_BYTES // (4 * in_features) // 64 * 64)


def quantize_int8(w: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8, w ≈ q * scale with q in [-qmax, qmax]: (q [N, K], scale [N] bf16)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / qmax).clamp(min=1e-12).to(_KERNEL_DTYPE)
    q = (w / scale.float()[:, None]).round_().clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


def quantize_int8_in_slices(w: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_int8` of a big weight (an LM head), `chunk_rows` at a time into the whole: the
    float32 temporaries stay one slice's."""
    n, k = w.shape
    q, scale = torch.empty((n, k), dtype=torch.int8), torch.empty(n, dtype=_KERNEL_DTYPE)
    chunk = chunk_rows(k)
    for i in range(0, n, chunk):
        q[i : i + chunk], scale[i : i + chunk] = quantize_int8(w[i : i + chunk], qmax)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


FP8_E4M3_MAX = 448.0  # float8 e4m3fn's largest finite value


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float8 e4m3 with a scale per output row, w ≈ q * scale: (q [N, K] float8_e4m3fn,
    scale [N] float32), as an FP8 checkpoint with per-channel scales holds a weight."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_E4M3_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of inputs in the kernel's convention, w ≈ (q - 8) * scale + zero
    with q in [0, 15]: (q [N, K] int32, scales_and_zeros [K / group, N, 2] bf16)."""
    n, k = w.shape
    w = w.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    # Round against the bf16 scale and zero the kernel will use, not the exact ones.
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(_KERNEL_DTYPE).float()
    zero = (lo + 8 * scale).to(_KERNEL_DTYPE).float()
    q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.int32)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(_KERNEL_DTYPE)
    return q.view(n, k), scales_and_zeros


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, groups, 2]
    groups = sz.shape[1]
    return ((q.view(n, groups, k // groups).float() - 8) * sz[..., :1] + sz[..., 1:]).view(n, k)


def int4_group_size(out_features: int, in_features: int) -> int | None:
    """The group size int4 uses for this shape, or None if the packing cannot take it."""
    if out_features % _INT4_ROW_MULTIPLE:
        return None
    return next((g for g in INT4_GROUP_SIZES if in_features % g == 0), None)


class WeightOnlyQuant(nn.Module):
    """The quantized form of one [out, in] weight and the kernel that multiplies by it.
    The owning layer calls it for at most `max_rows` rows and runs its float weight above.

    `layout`: "pagedllm" (int8 [N, K] with bf16 scales, or `cpu_kernels.pack_int4`'s int4)
    runs the C kernels; "torch" is PyTorch's packing for its own int8/int4 kernels."""

    def __init__(
        self, method: str, qweight: torch.Tensor, scales: torch.Tensor, in_features: int, group_size: int,
        max_rows: int, layout: str,
    ) -> None:
        super().__init__()
        self.method = method
        self.layout = layout
        self.in_features = in_features
        self.out_features = qweight.shape[0]
        self.group_size = group_size
        self.max_rows = max_rows
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    def rank(self, x: torch.Tensor) -> torch.Tensor:
        """Approximate outputs for ranking an LM head's vocabulary (its top candidates are then
        recomputed exactly): the int4 kernel with 8-bit activations, else `forward`."""
        if self.layout == "pagedllm" and self.method == "int4" and x.dtype in (torch.float32, torch.bfloat16):
            return cpu_kernels.w4a8_rank(x, self.qweight, self.scales, self.group_size)
        return self(x)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.layout == "pagedllm":
            xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.to(_KERNEL_DTYPE)  # e.g. float16
            if self.method == "int8":  # (the kernels take the bias in xk's dtype)
                out = cpu_kernels.w8a16_linear(xk, self.qweight, self.scales, bias)
            else:
                out = cpu_kernels.w4a16_linear(xk, self.qweight, self.scales, self.group_size, bias)
            return out.to(x.dtype)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(_KERNEL_DTYPE)
        if self.method == "int8":
            if self.qweight.shape[1] != self.in_features:  # padded for torch's kernel
                x2 = nn.functional.pad(x2, (0, self.qweight.shape[1] - self.in_features))
            out = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            out = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales)
        out = out.to(x.dtype).view(*shape[:-1], self.out_features)
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (
            f"{self.method}, in={self.in_features}, out={self.out_features}{group}, max_rows={self.max_rows}, "
            f"layout={self.layout}"
        )


def _on_own_kernels(weight: torch.Tensor, method: str, group: int) -> bool:
    """Whether pagedllm's C kernels take `weight` quantized by `method` (int4: in groups of
    `group`, which its kernel needs as whole 128-input blocks); else torch's kernels do."""
    ours = weight.device.type == "cpu" and cpu_kernels.kernels() is not None
    return ours and (method == "int8" or group % 128 == 0) and weight.shape[1] <= _MAX_KERNEL_K


def int4_kernels_take(weight: torch.Tensor) -> bool:
    """Whether `quantize_weight(weight, "int4", ...)` gives an int4 copy in pagedllm's layout
    (the one the decode plans bind), rather than int8 or torch's int4."""
    group = int4_group_size(*weight.shape)
    return group is not None and _on_own_kernels(weight, "int4", group)


def quantize_weight(weight: torch.Tensor, method: str, max_rows: int, write_back: bool = True) -> WeightOnlyQuant:
    """Quantize a [out, in] weight; with `write_back`, overwrite it in place with its
    dequantized values so the float path computes the same model as the kernel (up to the
    rounding of those values to the weight's dtype).
    int4 falls back to int8 for shapes its packing cannot take."""
    n, k = weight.shape
    group = int4_group_size(n, k) if method == "int4" else 0
    if method == "int4" and group is None:
        method, group = "int8", 0
    if method not in ("int8", "int4"):
        raise ValueError(f"unknown quantization method {method!r}")
    ours = _on_own_kernels(weight, method, group)
    # Written into the whole as the slices come, not collected and concatenated: no second copy
    # at the peak, and nothing kept is allocated between one slice's temporaries and the next's
    # (the heap would grow by their holes).
    qs = scales = None
    scale_dim = 1 if method == "int4" and not ours else 0  # torch's int4 scales: [groups, N, 2]
    chunk = chunk_rows(k)
    for start in range(0, n, chunk):
        rows = weight[start : start + chunk]
        if method == "int8":
            q, s = quantize_int8(rows)
            deq = dequantize_int8(q, s) if write_back else None
            if not ours and k % _TORCH_INT8_K_MULTIPLE:
                q = nn.functional.pad(q, (0, -k % _TORCH_INT8_K_MULTIPLE))
        else:
            q, s = quantize_int4(rows, group)
            deq = dequantize_int4(q, s) if write_back else None
            q, s = cpu_kernels.pack_int4(q, s) if ours else (torch._convert_weight_to_int4pack_for_cpu(q, 1), s)
        if qs is None:
            qs = q.new_empty((n, *q.shape[1:]))
            scales = s.new_empty((*s.shape[:scale_dim], n, *s.shape[scale_dim + 1 :]))
        qs[start : start + chunk] = q
        scales.narrow(scale_dim, start, s.shape[scale_dim]).copy_(s)
        if deq is not None:
            rows.copy_(deq)
    return WeightOnlyQuant(method, qs, scales, k, group, max_rows, "pagedllm" if ours else "torch")


class DynamicInt8Quant(nn.Module):
    """W8A8 for any number of rows: the weight in symmetric per-channel int8, each activation
    row quantized with its own scale (so a row's result never depends on the rows batched with
    it), multiplied as u8 x s8 with int32 accumulation: oneDNN's prepacked GEMM, or without
    VNNI the C kernel (`cpu_kernels.u8s8_rank`)."""

    def __init__(self, weight: torch.Tensor | None, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """From the float `weight`, or from its `quantized` (int8 weight, bf16 scale) as
        `int8_weight()` returned them (a cached copy)."""
        super().__init__()
        if quantized is None:  # the slices' temporaries handed back before oneDNN's packed copy is made
            quantized = quantize_int8_in_slices(weight, self.weight_qmax())
            release_freed_memory()
        qweight, scale = quantized
        self.out_features, self.in_features = qweight.shape
        self.qmax = self.weight_qmax()
        self.nbytes = qweight.numel() + 4 * scale.numel()
        # One path at every row count, so a row's logits never depend on its batch.
        self.runs_kernel = dynamic_runs_kernel()
        # The kernel runs on it; oneDNN's packed copy replaces it once `int8_weight` hands it over.
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = quantized
        # Each weight row's sum: the kernel's activations carry +128 (u8), taken out through it.
        self.w_sum = cpu_kernels.i8_row_sums(qweight) if self.runs_kernel else None
        self.packed = None if self.runs_kernel else torch.ops.onednn.qlinear_prepack(
            qweight, [_PACK_ROWS_HINT, self.in_features])
        self.register_buffer("w_scales", scale.float())
        self.register_buffer("w_zero_points", torch.zeros(scale.numel(), dtype=torch.long))
        # bf16 halves the output's bytes, but only CPUs where oneDNN runs bf16 have a fast
        # kernel that writes it (elsewhere: a reference loop, seconds per call).
        self.out_dtype = _KERNEL_DTYPE if onednn_has_bf16() else torch.float32

    @staticmethod
    def weight_qmax() -> int:
        """Without VNNI, pairs of u8 x s8 products are added in saturating int16 (vpmaddubsw, in
        oneDNN's GEMM and in the C kernel alike): weights up to 64 keep 2 x 255 x 64 in range
        (one bit less precision, still a ranking for the head)."""
        return 127 if cpu_isa.has_vnni() and not dynamic_runs_kernel() else 64

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 weight and bf16 scales before packing (e.g. for a cache); on oneDNN's path
        given once, then dropped."""
        quantized = self._int8
        if not self.runs_kernel:
            self._int8 = None
        if quantized is None:
            raise RuntimeError("the int8 weight was already handed over")
        return quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_kernel:
            xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
            return cpu_kernels.u8s8_rank(xk, *self._int8, self.w_sum).to(x.dtype)
        xf = x.float()
        # Each row's scale is rounded to bf16 before use, so multiplying the output by it
        # undoes exactly the scale the row was quantized with.
        scale = (xf.abs().amax(dim=-1, keepdim=True) / 127).clamp_(min=1e-12).to(_KERNEL_DTYPE)
        # u8 with zero point 128, not s8: oneDNN's fast (VNNI) kernels take u8 activations.
        xq = torch.round(xf / scale.float()).add_(128).to(torch.uint8)
        out = torch.ops.onednn.qlinear_pointwise(
            xq, 1.0, 128, self.packed, self.w_scales, self.w_zero_points, None, 1.0, 0, self.out_dtype,
            "none", [], "",
        )
        return out.mul_(scale.to(self.out_dtype)).to(x.dtype)


# Candidates re-scored when W8A8 ranked them: its logits are ~10x closer to the float head's
# than int4's, so far fewer are enough to hold the ones sampling can realistically pick.
DYNAMIC_TOP_K = 32


class QuantizedLMHead(nn.Module):
    """Logits from quantized copies of the head, optionally with each row's top candidates
    recomputed.

    `DynamicInt8Quant` serves any number of rows; a weight-only copy (`few_rows`, int4) may
    serve up to its `max_rows`, where streaming fewer bytes wins. With `top_k`, the quantized
    logits only rank the vocabulary: the candidates that sampling and greedy decoding can
    realistically pick (`top_k` of the few-rows ranking, at most `DYNAMIC_TOP_K` of W8A8's)
    get the float head's values, so both paths agree on them and quantization error is left
    in the tail. Selection and re-scoring are C kernels on CPU (~0.1 ms at batch 1, ~1 ms at
    64).
    """

    def __init__(self, dynamic: DynamicInt8Quant, few_rows: WeightOnlyQuant | None, top_k: int,
                 exact_rows: bool = False) -> None:
        """`exact_rows`: the rows `forward_context.exact_logit_rows` names (their log-softmax goes
        back to a user) get every logit from the float weight, as `GGUFRankedHead`'s do."""
        super().__init__()
        self.dynamic = dynamic
        self.few_rows = few_rows
        self.top_k = min(top_k, dynamic.out_features)
        self.exact_rows = exact_rows

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        top_k = self.top_k
        if self.few_rows is not None and hidden.shape[0] <= self.few_rows.max_rows:
            logits = self.few_rows.rank(hidden) if top_k else self.few_rows(hidden)
        else:
            logits = self.dynamic(hidden)
            top_k = min(top_k, DYNAMIC_TOP_K)
        if top_k:
            idx = top_k_indices(logits, top_k)
            if platform_of(logits, hidden, weight) == "cpu" and weight.is_contiguous():
                cpu_kernels.rescore_logits(logits, idx, hidden, weight)
            else:
                exact = torch.bmm(weight[idx].to(hidden.dtype), hidden.unsqueeze(-1)).squeeze(-1)
                logits.scatter_(1, idx, exact.to(logits.dtype))
        rows = get_exact_logit_rows() if self.exact_rows else None
        if rows is not None and rows.numel():
            logits[rows] = float_logits(hidden[rows], weight).to(logits.dtype)
        return logits


def float_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weight.T in hidden's dtype; a weight kept in a narrower dtype (a head mapped in its
    file's bf16) is widened a slice of rows at a time, never whole."""
    if weight.dtype == hidden.dtype:
        return nn.functional.linear(hidden, weight)
    out = hidden.new_empty((hidden.shape[0], weight.shape[0]))
    chunk = chunk_rows(weight.shape[1])
    for start in range(0, weight.shape[0], chunk):
        out[:, start : start + chunk] = nn.functional.linear(hidden, weight[start : start + chunk].to(hidden.dtype))
    return out
