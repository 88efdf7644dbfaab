"""Pre-quantized Hugging Face checkpoints: GPTQ, AWQ and compressed-tensors (pack-quantized),
read from `config.json`'s `quantization_config` as the Hub ships them.

Each quantized linear's packed tensors are unpacked to integers and float16 scales and
repacked, one module at a time, into GGUF blocks (`int_blocks`): the layers then hold them as
they hold a GGUF file's (`--quantization gguf`) and never a float copy. GPTQ's act-order
(`desc_act`, a `g_idx` that is not in input order) sorts the inputs by group, so every block of
32 has one scale; the layer gathers its input columns in that order (`BlockTensor.input_perm`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.transformers_utils.checkpoint_tensor import CheckpointTensor
from pagedllm.transformers_utils.int_blocks import BLOCK, encode_blocks, exact_float16

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors")
_AWQ_ORDER = np.argsort([0, 2, 4, 6, 1, 3, 5, 7])  # AWQ's nibble i holds column 8c + [0,2,4,6,1,3,5,7][i]
_PARTS = {
    "gptq": ({"qweight", "qzeros", "scales"}, {"g_idx"}),
    "awq": ({"qweight", "qzeros", "scales"}, set()),
    "compressed-tensors": ({"weight_packed", "weight_scale", "weight_shape"}, {"weight_g_idx", "weight_zero_point"}),
}


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """What a checkpoint's `quantization_config` says about its linears."""

    method: str
    bits: int
    group_size: int  # -1: one group over all inputs
    zero_offset: int = 0  # GPTQ's original format stores zero points minus one

    @property
    def parts(self) -> tuple[set[str], set[str]]:
        return _PARTS[self.method]


def read_quant_format(hf_config: Any) -> QuantFormat | None:
    """The checkpoint's format from its config, None for a float checkpoint; a format or
    variant pagedllm cannot run is a ValueError that names it."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        fmt = QuantFormat("gptq", int(qc.get("bits", 4)), int(qc.get("group_size", 128)),
                          0 if qc.get("checkpoint_format", "gptq") == "gptq_v2" else 1)
    elif method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only the GEMM layout)")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ without zero points is not supported")
        fmt = QuantFormat("awq", int(qc.get("bits", qc.get("w_bit", 4))),
                          int(qc.get("group_size", qc.get("q_group_size", 128))))
    elif method == "compressed-tensors":
        fmt = _compressed_tensors_format(qc)
    else:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; pagedllm reads "
                         f"{', '.join(CHECKPOINT_METHODS)} checkpoints (and GGUF files)")
    if fmt.bits not in (4, 8) or (fmt.method == "awq" and fmt.bits != 4):
        widths = "4-bit" if fmt.method == "awq" else "4-bit and 8-bit"
        raise ValueError(f"{fmt.method} with {fmt.bits}-bit weights is not supported ({widths} are)")
    if fmt.group_size != -1 and (fmt.group_size <= 0 or fmt.group_size % BLOCK):
        raise ValueError(f"{fmt.method} group size {fmt.group_size} is not supported: the kernels scale blocks of "
                         f"{BLOCK} inputs (group sizes 32, 64, 128, ... or -1)")
    return fmt


def _compressed_tensors_format(qc: dict) -> QuantFormat:
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (pack-quantized weight-only is)")
    schemes = list((qc.get("config_groups") or {}).values())
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors with {len(schemes)} config groups is not supported (one)")
    scheme = schemes[0]
    weights = scheme.get("weights") or {}
    if scheme.get("input_activations"):
        raise ValueError("compressed-tensors with quantized input activations is not supported (weight-only is)")
    if weights.get("type", "int") != "int" or weights.get("strategy") not in ("group", "channel"):
        raise ValueError(f"compressed-tensors weights of type {weights.get('type')!r} and strategy "
                         f"{weights.get('strategy')!r} are not supported (int, group or channel)")
    if not weights.get("symmetric", True):
        raise ValueError("asymmetric compressed-tensors weights are not supported (symmetric are)")
    group = int(weights.get("group_size") or -1) if weights["strategy"] == "group" else -1
    return QuantFormat("compressed-tensors", int(weights.get("num_bits", 4)), group)


class BlockTensor(CheckpointTensor):
    """A repacked linear weight offered to the layers as a GGUF file's native tensor is: rows of
    blocks (`block_rows`), cut by rows for column-parallel ranks (`rows`), or dequantized
    (`load`) for a loader that wants floats. `input_perm`: the input order of its columns."""

    __slots__ = ("name", "qtype", "blocks", "input_perm")
    native = True
    quantized = True

    def __init__(self, name: str, qtype: int, blocks: torch.Tensor, k: int, input_perm: torch.Tensor | None) -> None:
        self.name, self.qtype, self.blocks, self.input_perm = name, qtype, blocks, input_perm
        self.shape = torch.Size((blocks.shape[0], k))
        self.dtype = torch.float32

    def block_rows(self) -> torch.Tensor:
        return self.blocks

    def rows(self, start: int, length: int) -> BlockTensor:
        if not 0 <= start <= start + length <= self.shape[0]:
            raise IndexError(f"rows [{start}, {start + length}) of a tensor with {self.shape[0]}")
        return BlockTensor(self.name, self.qtype, self.blocks[start : start + length], self.shape[1], self.input_perm)

    def load(self) -> torch.Tensor:
        import gguf

        from pagedllm.transformers_utils.gguf_weights import dequantize_rows

        w = dequantize_rows(self.blocks.numpy(), gguf.GGMLQuantizationType(self.qtype).name, self.shape[1])
        if self.input_perm is None:
            return torch.from_numpy(w)
        out = torch.empty(w.shape)
        out[:, self.input_perm] = torch.from_numpy(w)
        return out

    def copy_to(self, target: torch.Tensor, dim: int = 0, start: int = 0) -> None:
        target.copy_(self.load().narrow(dim, start, target.shape[dim]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.load().narrow(dim, start, length)

    def mapped(self) -> None:
        return None


def _unpack(packed: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words of 32 / bits values each, low bits first, unpacked along `axis` (0 or 1)."""
    words = packed.astype(np.int32).view(np.uint32)
    shifts = np.arange(32 // bits, dtype=np.uint32) * bits
    mask = np.uint32((1 << bits) - 1)
    if axis == 0:
        return ((words[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, words.shape[1]).astype(np.int16)
    return ((words[:, :, None] >> shifts) & mask).reshape(words.shape[0], -1).astype(np.int16)


def _group_of_inputs(k: int, group_size: int, g_idx: np.ndarray | None) -> np.ndarray:
    if g_idx is not None:
        if g_idx.shape != (k,):
            raise ValueError(f"g_idx of shape {g_idx.shape} for {k} inputs")
        return g_idx.astype(np.int64)
    return np.arange(k) // (k if group_size == -1 else group_size)


def repack(fmt: QuantFormat, name: str, parts: dict[str, np.ndarray]) -> BlockTensor:
    """One module's packed tensors -> its weight as blocks (`name` + ".weight")."""
    if fmt.method == "compressed-tensors":
        n, k = (int(d) for d in parts["weight_shape"])
        if "weight_zero_point" in parts:
            raise ValueError(f"{name}: asymmetric compressed-tensors weights (weight_zero_point) are not supported")
        values = _unpack(parts["weight_packed"], fmt.bits, 1)[:, :k] - (1 << (fmt.bits - 1))  # [N, K]
        scales = parts["weight_scale"].reshape(n, -1)  # [N, G]
        groups = _group_of_inputs(k, k // scales.shape[1] if scales.shape[1] > 1 else -1, parts.get("weight_g_idx"))
        values, scales = values.T, scales.T  # [K, N], [G, N] as GPTQ has them
    else:
        awq = fmt.method == "awq"
        q = _unpack(parts["qweight"], fmt.bits, 1 if awq else 0)  # [K, N]
        zeros = _unpack(parts["qzeros"], fmt.bits, 1)
        if awq:
            q = q.reshape(q.shape[0], -1, 8)[..., _AWQ_ORDER].reshape(q.shape)
            zeros = zeros.reshape(zeros.shape[0], -1, 8)[..., _AWQ_ORDER].reshape(zeros.shape)
        k, n = q.shape
        scales = parts["scales"]  # [G, N]
        groups = _group_of_inputs(k, fmt.group_size, parts.get("g_idx"))
        values = q - (zeros[:, :n] + fmt.zero_offset)[groups]
    if groups.max(initial=0) >= scales.shape[0]:
        raise ValueError(f"{name}: inputs in group {int(groups.max())} of {scales.shape[0]}")
    perm = None
    if np.any(groups[1:] < groups[:-1]):  # act-order: inputs sorted by group
        perm = np.argsort(groups, kind="stable")
        values, groups = values[perm], groups[perm]
    block_groups = groups.reshape(-1, BLOCK) if k % BLOCK == 0 else None
    if block_groups is None or np.any(block_groups != block_groups[:, :1]):
        raise ValueError(f"{name}: its groups do not fall on whole blocks of {BLOCK} inputs")
    block_scales = exact_float16(scales, name)[block_groups[:, 0]].T  # [N, K / 32]
    qtype, blocks = encode_blocks(np.ascontiguousarray(values.T), np.ascontiguousarray(block_scales))
    return BlockTensor(name + ".weight", qtype, torch.from_numpy(blocks), k,
                       None if perm is None else torch.from_numpy(perm))


def iterate_quantized(weights: Iterator[tuple[str, Any]], fmt: QuantFormat) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each quantized module's packed parts replaced by one
    `<module>.weight` BlockTensor. A module's parts are read as they come (they are adjacent in
    a file's sorted names) and repacked once the next module's tensors start."""
    required, optional = fmt.parts
    known = required | optional
    pending: dict[str, dict[str, np.ndarray]] = {}

    def ready(final: bool) -> Iterator[tuple[str, BlockTensor]]:
        for prefix in list(pending):
            if required <= pending[prefix].keys():
                yield prefix + ".weight", repack(fmt, prefix, pending.pop(prefix))
            elif final:
                missing = ", ".join(sorted(required - pending[prefix].keys()))
                raise ValueError(f"{prefix}: the checkpoint lacks its {missing}")

    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in known:
            yield from ready(final=False)
            yield name, tensor
            continue
        if prefix not in pending:
            yield from ready(final=False)
        value = tensor.load() if isinstance(tensor, CheckpointTensor) else tensor
        pending.setdefault(prefix, {})[part] = value.float().numpy() if value.is_floating_point() else value.numpy()
    yield from ready(final=True)
