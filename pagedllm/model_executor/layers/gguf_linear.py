"""A weight kept as a GGUF file's own blocks (`--quantization gguf`): the linears, the embedding
and the LM head multiply by the memory-mapped rows of the file (`gguf_ops`, pagedllm/csrc/gguf.c)
and never hold a float copy, so a model takes the memory its file takes.

One layer's weight may come from several file tensors of different types (q/k/v, or gate/up,
stacked along the outputs; a Q4_K_M file keeps some of them in Q6_K): each is a segment of the
output rows, multiplied by its own kernel call straight into its columns of the output. Float
tensors of the file (F32/F16/BF16) are segments too, held in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.forward_context import get_exact_logit_rows
from pagedllm.model_executor.layers import cpu_kernels, gguf_ops
from pagedllm.model_executor.layers.quantization import (
    DYNAMIC_TOP_K,
    DynamicInt8Quant,
    WeightOnlyQuant,
    int4_group_size,
    quantize_int8,
    quantize_weight,
)
from pagedllm.model_executor.layers.sampler import top_k_indices
from pagedllm.transformers_utils.page_cache import drop_from_resident


@dataclass(slots=True)
class GGUFSegment:
    """Output rows [offset, offset + rows) of a weight: `weight` is uint8 [rows, bytes per row]
    of blocks of ggml type `qtype` (rows may be strided: a column slice; or `repacked`), or for a
    float type a float tensor [rows, in_features]. `out_scale`: float32 [rows], a factor on each output row
    (a per-channel or per-tensor scale of an int8 / FP8 checkpoint), or None."""

    offset: int
    qtype: int
    weight: torch.Tensor
    quantized: bool
    out_scale: torch.Tensor | None = None
    repacked: bool = False  # `weight` is `gguf_ops.repack`'s: 8 rows side by side

    @property
    def rows(self) -> int:
        return self.weight.shape[0]


class GGUFLinear(nn.Module):
    """y = x W^T (+ b) for a [out_features, in_features] weight made of GGUF segments."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.segments: list[GGUFSegment] = []
        self._gaps: list[tuple[int, int]] | None = None  # uncovered(), once the segments are in
        # The input order of the blocks' columns where it is not the layer's (a GPTQ act-order
        # checkpoint sorts inputs by group): every segment's, as they share one input.
        self.input_perm: torch.Tensor | None = None

    def add(self, offset: int, tensor, columns: tuple[int, int] | None = None) -> None:
        """Rows of a `GGUFTensor` (all of its rows) as output rows [offset, offset + its rows);
        `columns` (start, length): only those inputs, at block boundaries (a row-parallel rank)."""
        start, length = columns or (0, tensor.shape[1])
        perm = getattr(tensor, "input_perm", None)
        if perm is not None and columns is not None:
            raise ValueError(f"{tensor.name}: an act-order (g_idx) weight cannot be split over tensor-parallel "
                             "ranks by its inputs")
        if self.segments and not _same_order(perm, self.input_perm):
            raise ValueError(f"{tensor.name}: its input order (g_idx) differs from the other weights of its layer")
        self.input_perm = perm
        if length != self.in_features or not 0 <= offset <= offset + tensor.shape[0] <= self.out_features:
            raise ValueError(f"{tensor.name}: rows {tuple(tensor.shape)} at {offset} do not fit a "
                             f"[{self.out_features}, {self.in_features}] weight")
        if tensor.quantized:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor.qtype)]
            if start % block or length % block:
                raise ValueError(f"{tensor.name}: inputs [{start}, {start + length}) split its {block}-value blocks")
            weight = tensor.block_rows()
            if columns is not None:
                weight = weight[:, start // block * block_bytes : (start + length) // block * block_bytes]
        else:
            weight = tensor.load().narrow(1, start, length).to(self.dtype).contiguous()
        self.segments.append(GGUFSegment(offset, tensor.qtype, weight, tensor.quantized,
                                         getattr(tensor, "out_scale", None)))
        self.segments.sort(key=lambda s: s.offset)
        self._gaps = None

    def uncovered(self) -> list[tuple[int, int]]:
        """Output row ranges no segment fills (a vocabulary's padding rows); overlaps raise."""
        gaps, at = [], 0
        for seg in self.segments:
            if seg.offset < at:
                raise ValueError(f"GGUF segments overlap at output row {seg.offset}")
            if seg.offset > at:
                gaps.append((at, seg.offset))
            at = seg.offset + seg.rows
        if at < self.out_features:
            gaps.append((at, self.out_features))
        return gaps

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.input_perm is not None:
            x2 = x2.index_select(1, self.input_perm.to(x2.device))
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        out = x2.new_empty((x2.shape[0], self.out_features))
        if self._gaps is None:
            self._gaps = self.uncovered()
        for start, stop in self._gaps:
            out[:, start:stop] = 0
        for seg in self.segments:
            view = out[:, seg.offset : seg.offset + seg.rows]
            seg_bias = None if bias is None else bias[seg.offset : seg.offset + seg.rows]
            if seg.quantized:  # a factor on the outputs comes before the bias
                scaled = seg.out_scale is not None
                gguf_ops.gguf_linear(x2, seg.qtype, seg.weight, self.in_features, None if scaled else seg_bias,
                                     out=view, repacked=seg.repacked)
                if scaled:
                    scale_rows(view, seg.out_scale, seg_bias)
            else:
                view.copy_(F.linear(x2, seg.weight.to(x2.dtype), None if seg_bias is None else seg_bias.to(x2.dtype)))
        return out.view(*x.shape[:-1], self.out_features)

    def repackable(self) -> list[tuple[GGUFSegment, tuple[int, int]]]:
        """The segments `repack` takes, with their repacked shapes: Q4_K / Q6_K / Q5_0 / Q4_0 in whole
        groups of 8 rows, where the kernels run them with SIMD."""
        if not gguf_ops.repack_pays():
            return []
        return [(seg, (seg.rows, gguf_ops.repacked_row_bytes(seg.qtype, self.in_features)))
                for seg in self.segments if not seg.repacked and seg.quantized and seg.out_scale is None
                and gguf_ops.can_repack(seg.qtype, seg.weight)]

    def repack(self, alloc: Callable[[tuple[int, int]], torch.Tensor]) -> int:
        """Each of `repackable`'s segments repacked 8 rows side by side (`gguf_ops.repack`: decode's
        few activation rows run ~1.7x faster from cache) into `alloc(shape)`'s uint8 tensor (the
        loader's: one huge-page arena for the model); the file's pages of them leave this
        process's resident memory. The outputs stay the same bits. Returns the bytes repacked."""
        done = 0
        for seg, shape in self.repackable():
            out = alloc(shape)
            packed = gguf_ops.repack(seg.qtype, seg.weight, self.in_features, out=out)
            drop_from_resident(seg.weight)
            seg.weight, seg.repacked = packed, True
            done += packed.numel()
        return done

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized to the model's dtype: an embedding lookup."""
        if len(self.segments) != 1 or self.segments[0].offset != 0 or self.segments[0].repacked:
            raise ValueError("an embedding is one GGUF tensor in the file's layout")
        seg = self.segments[0]
        flat = ids.reshape(-1)
        if not seg.quantized:
            return F.embedding(ids, seg.weight)
        rows = gguf_ops.gguf_dequantize(seg.qtype, seg.weight, self.in_features, rows=flat, dtype=self.dtype)
        if seg.out_scale is not None:
            rows = rows * seg.out_scale[flat][:, None].to(rows.dtype)
        if self.input_perm is not None:  # the columns back in input order
            rows = torch.empty_like(rows).index_copy_(1, self.input_perm.to(rows.device), rows)
        return rows.view(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        kinds = sorted({gguf.GGMLQuantizationType(s.qtype).name for s in self.segments})
        return f"in={self.in_features}, out={self.out_features}, types={','.join(kinds)}"


def scale_rows(out: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """out = out * scale (+ bias), in place; the float32 scale multiplies before any rounding to
    out's dtype."""
    out.mul_(scale)
    return out if bias is None else out.add_(bias.to(out.dtype))


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


# Candidates re-scored from the blocks when the 4-bit copy ranked a row (as `QuantizedLMHead`'s
# int4 copy: enough to hold whatever sampling can realistically pick).
RANKED_TOP_K = 256


class GGUFRankedHead(nn.Module):
    """An LM head on GGUF blocks that ranks the vocabulary on copies, as `QuantizedLMHead` does:
    for a few rows (batch-1 decode) a 4-bit copy, since the head is the largest single read of a
    decode step (262,144 rows; in Q8_0 twice the bytes of int4 g128); for more rows a W8A8 copy
    (`DynamicInt8Quant`, a GEMM with per-row scales: ~3x the block kernel's speed at 64 rows).
    The copies only rank: each row's top candidates (`top_k`, `DYNAMIC_TOP_K` for W8A8) get their
    logits from the file's own rows (dequantized, a float dot product), so the tokens greedy
    decoding and sampling pick and their logits are the file's; the tail keeps a copy's values.
    Rows whose log-softmax a user gets (`forward_context.exact_logit_rows`) take the blocks'
    logits for the whole vocabulary instead of a copy's, and the same re-scoring: their
    normalizer is the file's (a 4-bit tail put the default model's perplexity 0.25% off)."""

    def __init__(self, blocks: GGUFLinear, few_rows: WeightOnlyQuant, many_rows: DynamicInt8Quant,
                 top_k: int = RANKED_TOP_K) -> None:
        super().__init__()
        self.blocks, self.few_rows, self.many_rows = blocks, few_rows, many_rows
        self.top_k = min(top_k, blocks.out_features)

    @classmethod
    def build(cls, blocks: GGUFLinear, max_rows: int, chunk_rows: int = 16384,
              saved: dict[str, torch.Tensor] | None = None,
              save: Callable[[dict[str, torch.Tensor]], None] | None = None) -> GGUFRankedHead | None:
        """The ranking copies quantized slice by slice from the dequantized blocks (no float copy
        of the whole head), or taken from `saved`, what an earlier build handed to `save` (the
        loader caches them on disk: the 12B head's copies take ~7 s to make on 2 cores); None
        where the int4 kernels cannot take this head."""
        seg = blocks.segments[0] if len(blocks.segments) == 1 else None
        if seg is None or not seg.quantized or seg.offset or seg.rows != blocks.out_features or \
                seg.out_scale is not None:
            return None
        group = int4_group_size(blocks.out_features, blocks.in_features)
        if cpu_kernels.kernels() is None or group is None:
            return None
        if saved is not None:
            copy = WeightOnlyQuant("int4", saved["few.qweight"], saved["few.scales"], blocks.in_features, group,
                                   max_rows, "pagedllm")
            if copy.qweight.shape[0] != blocks.out_features:
                raise ValueError(f"saved copies of {copy.qweight.shape[0]} rows for a head of {blocks.out_features}")
            return cls(blocks, copy, cls._many(saved["many.qweight"], saved["many.scales"]))
        parts, int8 = [], []
        for start in range(0, seg.rows, chunk_rows):
            rows = gguf_ops.gguf_dequantize(seg.qtype, seg.weight[start : start + chunk_rows], blocks.in_features)
            parts.append(quantize_weight(rows, "int4", max_rows, write_back=False))
            int8.append(quantize_int8(rows, DynamicInt8Quant.weight_qmax()))
        if any(p.layout != "pagedllm" or p.method != "int4" for p in parts):
            return None
        first = parts[0]
        copy = WeightOnlyQuant("int4", torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                               first.in_features, first.group_size, max_rows, first.layout)
        q8, s8 = torch.cat([q for q, _ in int8]), torch.cat([sc for _, sc in int8])
        if save is not None and first.group_size == group:
            save({"few.qweight": copy.qweight, "few.scales": copy.scales, "many.qweight": q8, "many.scales": s8})
        return cls(blocks, copy, cls._many(q8, s8))

    @staticmethod
    def _many(qweight: torch.Tensor, scales: torch.Tensor) -> DynamicInt8Quant:
        many = DynamicInt8Quant(None, (qweight, scales))
        if not many.runs_kernel:
            many.int8_weight()  # oneDNN keeps its packed copy only
        return many

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._ranked(hidden, exact=False)
        rows = get_exact_logit_rows()
        if rows is not None and rows.numel():
            logits[rows] = self._ranked(hidden[rows], exact=True)
        return logits

    def _ranked(self, hidden: torch.Tensor, exact: bool) -> torch.Tensor:
        if exact:
            logits, top_k = self.blocks(hidden), self.top_k
        elif hidden.shape[0] > self.few_rows.max_rows:
            logits, top_k = self.many_rows(hidden), min(self.top_k, DYNAMIC_TOP_K)
        else:
            logits, top_k = self.few_rows.rank(hidden), self.top_k
        idx = top_k_indices(logits, top_k)
        seg = self.blocks.segments[0]
        if self.blocks.input_perm is None and gguf_ops.gguf_rescore(seg.qtype, seg.weight, self.blocks.in_features,
                                                                     logits, idx, hidden):
            return logits
        m, k = idx.shape
        rows = self.blocks.lookup(idx.reshape(-1)).view(m, k, -1).to(hidden.dtype)
        exact = torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)
        return logits.scatter_(1, idx, exact.to(logits.dtype))
