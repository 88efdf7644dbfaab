"""`read_quant_format`: what each checkpoint's quantization_config runs as, and a clear
ValueError naming what is missing for each variant pagedllm cannot run."""

from __future__ import annotations

import pytest
from transformers import PretrainedConfig

from pagedllm.transformers_utils.quant_config import QuantFormat, read_quant_format
from tests.transformers_utils.quant_writers import _config, config_8bit


@pytest.mark.parametrize("config, want", [
    (_config("gptq", 4, 128, True, False, False), QuantFormat("gptq", 4, 128, 1)),
    (_config("gptq", 8, -1, True, True, True), QuantFormat("gptq", 8, -1, 0)),
    (_config("awq", 4, 64, False, False, False), QuantFormat("awq", 4, 64)),
    (_config("compressed-tensors", 4, 32, True, False, False), QuantFormat("compressed-tensors", 4, 32)),
    (config_8bit("fp8", static=True), QuantFormat("fp8", 8, -1, storage="float8")),
    (config_8bit("compressed-tensors", "float-quantized"), QuantFormat("compressed-tensors", 8, -1, storage="float8")),
    (config_8bit("compressed-tensors", "int-quantized", "group", 64),
     QuantFormat("compressed-tensors", 8, 64, storage="int8")),
    (config_8bit("fp8", strategy="block"), QuantFormat("fp8", 8, -1, storage="float8", weight_block=(128, 128))),
    (config_8bit("compressed-tensors", "float-quantized", "block", block=(64, 32)),
     QuantFormat("compressed-tensors", 8, -1, storage="float8", weight_block=(64, 32))),
])
def test_formats_read_from_the_config(config, want):
    assert read_quant_format(PretrainedConfig(quantization_config=config)) == want
    assert read_quant_format(PretrainedConfig()) is None


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 48]}, r"weight_block_size \[128, 48\] is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\]"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {}}, "naive-quantized"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "kv_cache_scheme": {"num_bits": 8}},
     "kv_cache_scheme"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 16]}}}},
     r"block_structure \[128, 16\]"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "block", "block_structure": [128, 128]}}}},
     "strategy 'block'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}}, "4-bit weights"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float"}}}}, "float input activations"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group size 16"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False}}}},
     "asymmetric"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "dynamic": True}}}}, "pack-quantized is weight-only"),
])
def test_unsupported_variants_are_named(qc, message):
    with pytest.raises(ValueError, match=message):
        read_quant_format(PretrainedConfig(quantization_config=qc))


