"""What a pre-quantized checkpoint's `quantization_config` (config.json) says about its linears,
as the Hub's GPTQ, AWQ, FP8 and compressed-tensors checkpoints write it, and which of its
tensors are a quantized module's parts. A format or variant pagedllm cannot run is refused
here, at start, with what is missing named (`read_quant_format`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.transformers_utils.int_blocks import BLOCK

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
_PARTS = {
    "gptq": ({"qweight", "qzeros", "scales"}, {"g_idx"}),
    "awq": ({"qweight", "qzeros", "scales"}, set()),
    "compressed-tensors": ({"weight_packed", "weight_scale", "weight_shape"}, {"weight_g_idx", "weight_zero_point"}),
}
# Formats whose quantized weight is a plain `weight` tensor (int8, or float8 e4m3) beside its scale
_UNPACKED_PARTS = ({"weight", "weight_scale"}, {"input_scale", "input_zero_point", "weight_zero_point"})
# FP8 with block-wise scales (`weight_block_size`), as DeepSeek-V3's and Qwen3's FP8 checkpoints
# write it: the scale, one per block of outputs x inputs, is named `weight_scale_inv`.
_BLOCK_FP8_PARTS = ({"weight", "weight_scale_inv"}, {"input_scale"})
_STORED_DTYPES = {"int8": torch.int8, "float8": torch.float8_e4m3fn}


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """What a checkpoint's `quantization_config` says about its linears."""

    method: str
    bits: int
    group_size: int  # -1: one group over all inputs
    zero_offset: int = 0  # GPTQ's original format stores zero points minus one
    storage: str = "packed"  # int32 words of 4/8-bit values; or "int8" / "float8": a `weight` of that type
    weight_block: tuple[int, int] | None = None  # float8 scales per block of (outputs, inputs)

    @property
    def parts(self) -> tuple[set[str], set[str]]:
        if self.storage == "packed":
            return _PARTS[self.method]
        return _BLOCK_FP8_PARTS if self.method == "fp8" and self.weight_block else _UNPACKED_PARTS

    def is_part(self, part: str, tensor: Any) -> bool:
        """Whether a checkpoint tensor named `<module>.<part>` is one of a quantized module's
        parts: an unpacked format's `weight` is one only in the stored type (an ignored layer's,
        such as the LM head's, is a float weight like any other)."""
        required, optional = self.parts
        if part == "weight" and self.storage != "packed":
            return getattr(tensor, "dtype", None) == _STORED_DTYPES[self.storage]
        return part in required | optional


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
    elif method == "fp8":
        if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
            raise ValueError(f"fp8 with fmt {qc['fmt']!r} is not supported (e4m3 weights are)")
        fmt = QuantFormat("fp8", 8, -1, storage="float8",
                          weight_block=_weight_block(qc.get("weight_block_size"), "fp8 weight_block_size"))
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


def _weight_block(block: Any, what: str) -> tuple[int, int] | None:
    """A block-wise scale's (outputs, inputs) extent; its inputs must be whole blocks of 32, the
    kernels' scale granularity."""
    if not block:
        return None
    if len(block) != 2 or min(int(b) for b in block) <= 0 or int(block[1]) % BLOCK:
        raise ValueError(f"{what} {list(block)} is not supported: [outputs, inputs] with inputs a multiple of "
                         f"{BLOCK} (as [128, 128]) is")
    return int(block[0]), int(block[1])


# compressed-tensors formats: (the weights' type, their storage, the strategies taken)
_CT_FORMATS = {
    "pack-quantized": ("int", "packed", ("group", "channel")),
    "int-quantized": ("int", "int8", ("group", "channel", "tensor")),
    "float-quantized": ("float", "float8", ("channel", "tensor", "block")),
}


def _compressed_tensors_format(qc: dict) -> QuantFormat:
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported ({', '.join(_CT_FORMATS)} are)")
    kind, storage, strategies = _CT_FORMATS[fmt]
    if qc.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme is not supported: use --kv-cache-dtype, whose "
                         "scales are computed as the cache is written")
    schemes = list((qc.get("config_groups") or {}).values())
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors with {len(schemes)} config groups is not supported (one)")
    scheme = schemes[0]
    weights, acts = scheme.get("weights") or {}, scheme.get("input_activations")
    if acts and (storage == "packed" or acts.get("type", kind) != kind or int(acts.get("num_bits", 8)) != 8):
        raise ValueError(f"compressed-tensors {fmt} with {acts.get('num_bits')}-bit {acts.get('type')} input "
                         "activations is not supported (8-bit activations of the weights' type, beside 8-bit "
                         "int-quantized or float-quantized weights, are; pack-quantized is weight-only)")
    if weights.get("type", "int") != kind or weights.get("strategy") not in strategies:
        raise ValueError(f"compressed-tensors {fmt} weights of type {weights.get('type')!r} and strategy "
                         f"{weights.get('strategy')!r} are not supported ({kind}, {' or '.join(strategies)})")
    if not weights.get("symmetric", True):
        raise ValueError("asymmetric compressed-tensors weights are not supported (symmetric are)")
    bits = int(weights.get("num_bits", 4))
    if storage != "packed" and bits != 8:
        raise ValueError(f"compressed-tensors {fmt} with {bits}-bit weights is not supported (8-bit is)")
    group = int(weights.get("group_size") or -1) if weights["strategy"] == "group" else -1
    block = None
    if weights["strategy"] == "block":
        block = _weight_block(weights.get("block_structure") or [0], "compressed-tensors block_structure")
    return QuantFormat("compressed-tensors", bits, group, storage=storage, weight_block=block)
