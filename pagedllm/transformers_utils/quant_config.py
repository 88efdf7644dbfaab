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
_STORED_DTYPES = {"int8": torch.int8, "float8": torch.float8_e4m3fn}


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """What a checkpoint's `quantization_config` says about its linears."""

    method: str
    bits: int
    group_size: int  # -1: one group over all inputs
    zero_offset: int = 0  # GPTQ's original format stores zero points minus one
    storage: str = "packed"  # int32 words of 4/8-bit values; or "int8" / "float8": a `weight` of that type

    @property
    def parts(self) -> tuple[set[str], set[str]]:
        return _PARTS[self.method] if self.storage == "packed" else _UNPACKED_PARTS

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
        if qc.get("weight_block_size"):
            raise ValueError(f"fp8 with weight_block_size {qc['weight_block_size']} is not supported (scales per "
                             "tensor or per output channel are)")
        fmt = QuantFormat("fp8", 8, -1, storage="float8")
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


# compressed-tensors formats: (the weights' type, their storage, the strategies taken)
_CT_FORMATS = {
    "pack-quantized": ("int", "packed", ("group", "channel")),
    "int-quantized": ("int", "int8", ("group", "channel", "tensor")),
    "float-quantized": ("float", "float8", ("channel", "tensor")),
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
    return QuantFormat("compressed-tensors", bits, group, storage=storage)
