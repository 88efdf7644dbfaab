"""Pre-quantized Hugging Face checkpoints: GPTQ, AWQ, FP8 and compressed-tensors
(pack-quantized, int-quantized, float-quantized), read from `config.json`'s
`quantization_config` as the Hub ships them.

Each quantized linear's tensors are unpacked to integers and scales and repacked, one module at
a time, into GGUF blocks (`int_blocks`): the layers then hold them as they hold a GGUF file's
(`--quantization gguf`) and never a float copy. GPTQ's act-order (`desc_act`, a `g_idx` that is
not in input order) sorts the inputs by group, so every block of 32 has one scale; the layer
gathers its input columns in that order (`BlockTensor.input_perm`). A scale per output channel
or per tensor (int8 W8A8, FP8) stays a float32 factor on the layer's outputs
(`BlockTensor.out_scale`), so it needs no float16 form; block-wise FP8 scales (DeepSeek-V3's,
Qwen3's FP8 checkpoints) give each row its largest as that factor and each block of 32 its
ratio to it in the block's float16 scale. Float8 weights become int8 blocks with
power-of-two scales (`int_blocks.float_blocks`: exact for all but a block's smallest values).
The checkpoint's activation scales are not used: the kernels quantize activations to int8 per
32 values at run time, as for GGUF files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from pagedllm.transformers_utils.checkpoint_tensor import CheckpointTensor
from pagedllm.transformers_utils.int_blocks import BLOCK, Q8_0, encode_blocks, exact_float16, float_blocks
from pagedllm.transformers_utils.quant_config import QuantFormat

_AWQ_ORDER = np.argsort([0, 2, 4, 6, 1, 3, 5, 7])  # AWQ's nibble i holds column 8c + [0,2,4,6,1,3,5,7][i]


class BlockTensor(CheckpointTensor):
    """A repacked linear weight offered to the layers as a GGUF file's native tensor is: rows of
    blocks (`block_rows`), cut by rows for column-parallel ranks (`rows`), or dequantized
    (`load`) for a loader that wants floats. `input_perm`: the input order of its columns;
    `out_scale`: float32 [rows], each output row's factor on top of its blocks' scales."""

    __slots__ = ("name", "qtype", "blocks", "input_perm", "out_scale")
    native = True
    quantized = True

    def __init__(self, name: str, qtype: int, blocks: torch.Tensor, k: int, input_perm: torch.Tensor | None,
                 out_scale: torch.Tensor | None = None) -> None:
        self.name, self.qtype, self.blocks, self.input_perm = name, qtype, blocks, input_perm
        self.out_scale = out_scale
        self.shape = torch.Size((blocks.shape[0], k))
        self.dtype = torch.float32

    def block_rows(self) -> torch.Tensor:
        return self.blocks

    def rows(self, start: int, length: int) -> BlockTensor:
        if not 0 <= start <= start + length <= self.shape[0]:
            raise IndexError(f"rows [{start}, {start + length}) of a tensor with {self.shape[0]}")
        scale = None if self.out_scale is None else self.out_scale[start : start + length]
        return BlockTensor(self.name, self.qtype, self.blocks[start : start + length], self.shape[1], self.input_perm,
                           scale)

    def load(self) -> torch.Tensor:
        import gguf

        from pagedllm.transformers_utils.gguf_weights import dequantize_rows

        w = torch.from_numpy(dequantize_rows(self.blocks.numpy(), gguf.GGMLQuantizationType(self.qtype).name,
                                             self.shape[1]))
        if self.out_scale is not None:
            w = w * self.out_scale[:, None]
        if self.input_perm is None:
            return w
        out = torch.empty(w.shape)
        out[:, self.input_perm] = w
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
    if fmt.storage != "packed":
        return _repack_unpacked(fmt, name, parts)
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


_CHUNK_ROWS = 512  # rows repacked at once: bounds the float32 temporaries of a big weight


def _repack_unpacked(fmt: QuantFormat, name: str, parts: dict[str, np.ndarray]) -> BlockTensor:
    """An int8 or float8 (its bytes) `weight` [N, K] with its scale as Q8_0 blocks: a scale per
    tensor or per output channel becomes a float32 factor on the outputs; per group of inputs
    (int8 only) the blocks' float16 scales; per block of outputs x inputs (float8) both.
    Written a slice of rows at a time into the blocks."""
    weight = parts["weight"]
    scale = parts["weight_scale_inv" if "weight_scale_inv" in parts else "weight_scale"].astype(np.float32)
    n, k = weight.shape
    zero = parts.get("weight_zero_point")
    if zero is not None and np.any(zero != 0):
        raise ValueError(f"{name}: asymmetric weights (a nonzero weight_zero_point) are not supported")
    if k % BLOCK:
        raise ValueError(f"{name}: {k} inputs are not whole blocks of {BLOCK}")
    out_scale, group_scales, tile_scales = None, None, None
    if fmt.weight_block:
        out_scale, tile_scales = _block_scales(fmt.weight_block, scale, n, k, name)
    elif scale.size in (1, n):
        out_scale = torch.from_numpy(np.broadcast_to(scale.reshape(-1), (n,)).copy())
    elif fmt.storage == "int8" and scale.size % n == 0 and k % (scale.size // n) == 0 \
            and (k // (scale.size // n)) % BLOCK == 0:
        group = k // (scale.size // n)
        group_scales = np.repeat(exact_float16(scale.reshape(n, -1), name), group // BLOCK, axis=1)
    else:
        raise ValueError(f"{name}: a weight_scale of shape {scale.shape} for a [{n}, {k}] weight is not supported "
                         "(per tensor, per output channel, or for int8 per group of a multiple of 32 inputs)")
    blocks = np.empty((n, k // BLOCK * (2 + BLOCK)), np.uint8)
    for start in range(0, n, _CHUNK_ROWS):
        rows = slice(start, min(start + _CHUNK_ROWS, n))
        if fmt.storage == "float8":
            values, block_scales, _ = float_blocks(torch.from_numpy(weight[rows]).view(torch.float8_e4m3fn)
                                                   .float().numpy())
            if tile_scales is not None:  # each block's share of its tile's scale, rounded once to float16
                block_scales = (block_scales.astype(np.float32) * tile_scales(rows)).astype(np.float16)
        else:
            values = weight[rows]
            block_scales = group_scales[rows] if group_scales is not None else \
                np.ones((values.shape[0], k // BLOCK), np.float16)
        encode_blocks(values, block_scales, out=blocks[rows])
    return BlockTensor(name + ".weight", Q8_0, torch.from_numpy(blocks), k, None, out_scale)


def _block_scales(block: tuple[int, int], scale: np.ndarray, n: int, k: int,
                  name: str) -> tuple[torch.Tensor, Callable[[slice], np.ndarray]]:
    """Block-wise float8 scales ([ceil(N / bn), ceil(K / bk)]) as a float32 factor per output row
    (its largest tile scale) and, for rows, each 32-input block's ratio to it (in (0, 1]), which
    the block's float16 scale takes on: one rounding to float16's 11 bits per block."""
    bn, bk = block
    tiles = (-(-n // bn), -(-k // bk))
    if scale.shape != tiles:
        raise ValueError(f"{name}: a block scale of shape {scale.shape} for a [{n}, {k}] weight in blocks of "
                         f"[{bn}, {bk}]: {list(tiles)} expected")
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(f"{name}: its block scales must be positive and finite")
    out_scale = scale.max(axis=1).repeat(bn)[:n]

    def ratios(rows: slice) -> np.ndarray:
        tile_rows = scale[np.arange(rows.start, rows.stop) // bn]  # [rows, K / bk]
        per_block = np.repeat(tile_rows, bk // BLOCK, axis=1)[:, : k // BLOCK]
        return per_block / out_scale[rows, None]

    return torch.from_numpy(np.ascontiguousarray(out_scale)), ratios


def iterate_quantized(weights: Iterator[tuple[str, Any]], fmt: QuantFormat) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each quantized module's packed parts replaced by one
    `<module>.weight` BlockTensor. A module's parts are read as they come (they are adjacent in
    a file's sorted names) and repacked once the next module's tensors start."""
    required, _ = fmt.parts
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
        if not fmt.is_part(part, tensor):
            yield from ready(final=False)
            yield name, tensor
            continue
        if prefix not in pending:
            yield from ready(final=False)
        value = tensor.load() if isinstance(tensor, CheckpointTensor) else tensor
        if value.dtype == torch.float8_e4m3fn:  # kept as its bytes: 1/4 of float32's memory
            value = value.view(torch.uint8)
        pending.setdefault(prefix, {})[part] = value.float().numpy() if value.is_floating_point() else value.numpy()
    yield from ready(final=True)
