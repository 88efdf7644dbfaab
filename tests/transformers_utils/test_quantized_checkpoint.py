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
from pagedllm.transformers_utils.quant_config import QuantFormat, read_quant_format
from pagedllm.transformers_utils.quantized_checkpoint import BlockTensor, iterate_quantized
from tests.transformers_utils.quant_writers import _config, config_8bit, write_8bit, write_quantized


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


def test_asymmetric_8_bit_and_missing_parts_are_clear_errors():
    with pytest.raises(ValueError, match="asymmetric 8-bit"):
        int_blocks.block_type_for(-200, 100)
    fmt = QuantFormat("gptq", 4, 128, 1)
    parts = [("layer.qweight", torch.zeros(32, 64, dtype=torch.int32)), ("layer.scales", torch.ones(2, 64))]
    with pytest.raises(ValueError, match="lacks its qzeros"):
        list(iterate_quantized(iter(parts), fmt))
    with pytest.raises(ValueError, match="not exact in float16"):
        int_blocks.exact_float16(np.array([1e-9], np.float32), "layer")


CASES_8BIT = [
    dict(method="fp8"),  # e4m3, one scale per tensor
    dict(method="fp8", static=True),
    dict(method="compressed-tensors", fmt="float-quantized", strategy="channel"),
    dict(method="compressed-tensors", fmt="float-quantized", strategy="tensor", static=True),
    dict(method="compressed-tensors", fmt="int-quantized", strategy="channel"),  # W8A8
    dict(method="compressed-tensors", fmt="int-quantized", strategy="tensor", static=True),
    dict(method="compressed-tensors", fmt="int-quantized", strategy="group", scale_dtype=torch.float16),
]


@pytest.mark.parametrize("case", CASES_8BIT, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_8bit_repack(tmp_path, case):
    """int8 weights repack bit for bit. Float8 ones become int8 blocks with power-of-two scales:
    every value within 2^3 of its block's largest is exact, smaller ones move by at most half a
    step of their block, and the scales per tensor or channel stay float32 factors on the outputs."""
    from safetensors import safe_open

    src = _layer_dir(tmp_path)
    ref = write_8bit(src, tmp_path / "q", **case)["model.layers.0.mlp.up_proj.weight"]
    cfg = config_8bit(case["method"], case.get("fmt", ""), case.get("strategy", "channel"),
                      static=case.get("static", False))
    fmt = read_quant_format(PretrainedConfig(quantization_config=cfg))
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        tensors = [(name, f.get_tensor(name)) for name in f.keys()]
    got = dict(iterate_quantized(iter(tensors), fmt))
    assert set(got) == {"model.layers.0.mlp.up_proj.weight", "model.norm.weight"}  # input scales are used up
    weight = got["model.layers.0.mlp.up_proj.weight"]
    assert weight.qtype == int_blocks.Q8_0
    assert (weight.out_scale is not None) == (case.get("strategy") != "group")
    deq = weight.load()
    if case.get("fmt") == "int-quantized":
        torch.testing.assert_close(deq, ref, rtol=0, atol=0)
        return
    torch.testing.assert_close(deq, ref, rtol=0, atol=float(ref.abs().max()) / 120)  # half a step: max / 2^7
    # The blocks against the checkpoint's e4m3 values, before the float32 factor
    stored = dict(tensors)["model.layers.0.mlp.up_proj.weight"].float().view(64, -1, 32)
    blocks = BlockTensor("w", weight.qtype, weight.blocks, 256, None).load().view(64, -1, 32)
    step = torch.exp2(torch.floor(torch.log2(stored.abs().amax(dim=-1, keepdim=True))) - 6)
    big = stored.abs() >= 8 * step
    assert torch.equal(blocks[big], stored[big]) and big.float().mean() > 0.8
    assert torch.all((blocks - stored).abs() <= step / 2)
    torch.testing.assert_close(weight.out_scale * 448, ref.abs().amax(dim=1) if case.get("strategy") == "channel"
                               else ref.abs().amax().expand(64), rtol=0.07, atol=0)


@pytest.mark.parametrize("method, fmt, block", [("fp8", "", (16, 128)), ("fp8", "", (128, 128)),
                                               ("compressed-tensors", "float-quantized", (24, 96))])
def test_block_wise_fp8_repack(tmp_path, method, fmt, block):
    """Float8 with a scale per block of outputs x inputs (DeepSeek-V3's and Qwen3's FP8 layout,
    `weight_scale_inv`; compressed-tensors' "block" strategy), including partial last blocks
    (24 x 96 over [64, 256]): each row's largest block scale is its float32 factor, and each block of
    32 carries its ratio to it in its float16 scale. Values within 2^3 of a block's largest are then
    the checkpoint's up to that one float16 rounding of the scale (2^-11); smaller ones move by at
    most half a step."""
    from safetensors import safe_open

    src = _layer_dir(tmp_path)
    with safe_open(str(src / "model.safetensors"), "pt") as f:  # rows of very different magnitudes
        w = f.get_tensor("model.layers.0.mlp.up_proj.weight") * torch.logspace(-2, 1, 64)[:, None]
    from safetensors.torch import save_file
    save_file({"model.layers.0.mlp.up_proj.weight": w, "model.norm.weight": torch.ones(256)},
              str(src / "model.safetensors"))
    ref = write_8bit(src, tmp_path / "q", method, fmt, "block", block=block)["model.layers.0.mlp.up_proj.weight"]
    fmt_read = read_quant_format(PretrainedConfig(quantization_config=config_8bit(method, fmt, "block",
                                                                                   block=block)))
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        tensors = [(name, f.get_tensor(name)) for name in f.keys()]
    stored = dict(tensors)
    scale = stored["model.layers.0.mlp.up_proj." + ("weight_scale_inv" if method == "fp8" else "weight_scale")]
    assert scale.shape == (-(-64 // block[0]), -(-256 // block[1]))
    weight = dict(iterate_quantized(iter(tensors), fmt_read))["model.layers.0.mlp.up_proj.weight"]
    assert weight.qtype == int_blocks.Q8_0
    torch.testing.assert_close(weight.out_scale, scale.amax(dim=1).repeat_interleave(block[0])[:64])
    deq = weight.load().view(64, -1, 32)
    ref = ref.view(64, -1, 32)
    top = ref.abs().amax(dim=-1, keepdim=True)
    e4m3 = stored["model.layers.0.mlp.up_proj.weight"].float().view(64, -1, 32)
    big = e4m3.abs() >= 8 * torch.exp2(torch.floor(torch.log2(e4m3.abs().amax(dim=-1, keepdim=True))) - 6)
    assert big.float().mean() > 0.8
    assert torch.all((deq - ref)[big].abs() <= ref[big].abs() * 2.0 ** -11)
    assert torch.all((deq - ref).abs() <= top * (2.0 ** -7 + 2.0 ** -10))  # half a step, plus the scale's rounding


def test_block_wise_fp8_scales_of_the_wrong_shape_are_named(tmp_path):
    src = _layer_dir(tmp_path)
    write_8bit(src, tmp_path / "q", "fp8", strategy="block", block=(32, 128))
    fmt = read_quant_format(PretrainedConfig(quantization_config=config_8bit("fp8", strategy="block", block=(64, 128))))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        tensors = [(name, f.get_tensor(name)) for name in f.keys()]
    with pytest.raises(ValueError, match=r"up_proj: a block scale of shape \(2, 2\) .* \[1, 2\] expected"):
        dict(iterate_quantized(iter(tensors), fmt))


def test_float_blocks_round_small_values_to_the_block_step():
    values = np.zeros((1, 32), np.float32)
    values[0, :4] = [448.0, -0.875, 3.25, 0.001953125]  # e4m3: 1.75 * 2^8, -1.75 * 2^-1, 1.625 * 2, 2^-9
    q, d, inexact = int_blocks.float_blocks(values)
    assert d[0, 0] == np.float16(4.0)  # 2^(8 - 6)
    assert list(q[0, :4]) == [112, 0, 1, 0] and inexact == 3
    q, d, inexact = int_blocks.float_blocks(np.full((2, 32), 2.0 ** -20, np.float32))
    assert float(d[0, 0]) == 2.0 ** -24 and q[0, 0] == 16 and inexact == 0
