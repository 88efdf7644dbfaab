"""GPTQ, AWQ and compressed-tensors weights repacked into GGUF blocks: bit for bit the weights
the checkpoint stands for (each layout's packing, zero points, act-order, group sizes), and
clear errors for what is not supported."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import PretrainedConfig

from pagedllm.transformers_utils import int_blocks
from pagedllm.transformers_utils.quantized_checkpoint import QuantFormat, iterate_quantized, read_quant_format
from tests.transformers_utils.quant_writers import _config, write_quantized


def _layer_dir(tmp_path, n: int = 64, k: int = 256, seed: int = 0):
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    src = tmp_path / "src"
    src.mkdir()
    w = torch.randn(n, k) * 0.05
    save_file({"model.layers.0.mlp.up_proj.weight": w, "model.norm.weight": torch.ones(k)},
              str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    return src


CASES = [
    dict(method="gptq", bits=4, group=128, sym=True),  # Q4_0
    dict(method="gptq", bits=4, group=32, sym=False, desc_act=True),  # Q5_0, inputs permuted
    dict(method="gptq", bits=4, group=-1, sym=False, v2=True),
    dict(method="gptq", bits=8, group=64, sym=True),  # Q8_0
    dict(method="awq", bits=4, group=64, sym=False),
    dict(method="compressed-tensors", bits=4, group=128, sym=True),
    dict(method="compressed-tensors", bits=4, group=-1, sym=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_repack_is_bit_exact(tmp_path, case):
    from safetensors import safe_open

    src = _layer_dir(tmp_path)
    ref = write_quantized(src, tmp_path / "q", **case)
    fmt = read_quant_format(PretrainedConfig(quantization_config=_config(case["method"], case["bits"], case["group"],
                                                                            case["sym"], case.get("desc_act", False),
                                                                            case.get("v2", False))))
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        tensors = [(name, f.get_tensor(name)) for name in f.keys()]
    got = dict(iterate_quantized(iter(tensors), fmt))
    weight = got["model.layers.0.mlp.up_proj.weight"]
    assert weight.native and weight.quantized
    want = {(4, True): int_blocks.Q4_0, (4, False): int_blocks.Q5_0, (8, True): int_blocks.Q8_0}
    assert weight.qtype == want[case["bits"], case["sym"]]
    assert (weight.input_perm is not None) == bool(case.get("desc_act"))
    torch.testing.assert_close(weight.load(), ref["model.layers.0.mlp.up_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(weight.rows(8, 16).load(), ref["model.layers.0.mlp.up_proj.weight"][8:24],
                               rtol=0, atol=0)
    torch.testing.assert_close(got["model.norm.weight"], torch.ones(256))  # float tensors pass through


def test_encode_blocks_match_gguf_dequantize():
    rng = np.random.default_rng(0)
    for lo, hi, qtype in ((-8, 7, int_blocks.Q4_0), (-16, 15, int_blocks.Q5_0), (-128, 127, int_blocks.Q8_0)):
        values = rng.integers(lo, hi + 1, (5, 96))
        values[0, 0], values[0, 1] = lo, hi
        scales = rng.uniform(1e-3, 1e-1, (5, 3)).astype(np.float16)
        got_type, blocks = int_blocks.encode_blocks(values, scales)
        assert got_type == qtype
        deq = np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype))).reshape(5, 96)
        np.testing.assert_array_equal(deq, values * np.repeat(scales.astype(np.float32), 32, axis=1))


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "fp8"}, "'fp8' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group size 16"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}}, "float-quantized"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False}}}},
     "asymmetric"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "dynamic": True}}}}, "input activations"),
])
def test_unsupported_variants_are_named(qc, message):
    with pytest.raises(ValueError, match=message):
        read_quant_format(PretrainedConfig(quantization_config=qc))


def test_asymmetric_8_bit_and_missing_parts_are_clear_errors():
    with pytest.raises(ValueError, match="asymmetric 8-bit"):
        int_blocks.block_type_for(-200, 100)
    fmt = QuantFormat("gptq", 4, 128, 1)
    parts = [("layer.qweight", torch.zeros(32, 64, dtype=torch.int32)), ("layer.scales", torch.ones(2, 64))]
    with pytest.raises(ValueError, match="lacks its qzeros"):
        list(iterate_quantized(iter(parts), fmt))
    with pytest.raises(ValueError, match="not exact in float16"):
        int_blocks.exact_float16(np.array([1e-9], np.float32), "layer")
