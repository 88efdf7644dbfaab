"""The quantized KV cache's write and read (kv_quant.py): the C write stores the bytes and the
per-32 scales torch's quantize gives, bit for bit, on each kernel build; every byte reads back as
torch's float8 / int8 value; and a round trip stays within the type's rounding of its group."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.layers import cpu_kernels, kv_quant

pytestmark = pytest.mark.usefixtures("kernel_isa")

KINDS = ["int8", "fp8_e4m3", "fp8_e5m2"]


def _values(n: int, hk: int, d: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Vectors of very different magnitudes (subnormal bytes among them), one all zero, one with a
    lone large element, ties for int8's rounding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hk, d, generator=g) * torch.logspace(-3, 3, n)[:, None, None]
    x[0, 0] = 0
    x[1, 0, 5] = 1e4
    x[2, 0] = torch.arange(d) % 32 - 16  # each group's absmax 16: x / 16 * 127 has halves
    return x.to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_write_stores_what_torch_quantize_gives(kind, dtype, kernel_isa):
    if kernel_isa is None:
        pytest.skip("no C kernels built here")
    quant = kv_quant.kv_quant_for(kind)
    n, hk, d, blocks, bs = 24, 2, 64, 8, 4
    k, v = _values(n, hk, d, dtype), _values(n, hk, d, dtype, seed=1)
    slots = torch.randperm(blocks * bs)[:n]
    cache = torch.zeros(2, blocks, bs, hk, d, dtype=torch.uint8)
    scales = torch.zeros(2, blocks, bs, hk, d // 32)
    cpu_kernels.kv_cache_write(k, v, slots, cache, scales, quant.kind)
    for i, x in enumerate((k, v)):
        data, scale = kv_quant.quantize(x, quant)
        assert torch.equal(cache[i].view(-1, hk, d)[slots], data)
        assert torch.equal(scales[i].view(-1, hk, d // 32)[slots], scale)


@pytest.mark.parametrize("kind", KINDS)
def test_write_through_a_strided_v(kind, kernel_isa):
    """The decode plan hands v as a view of the qkv rows (row stride > hk * d)."""
    if kernel_isa is None:
        pytest.skip("no C kernels built here")
    quant = kv_quant.kv_quant_for(kind)
    qkv = _values(5, 6, 32, torch.float32).view(5, 6 * 32)
    k, v = qkv[:, 64:128].reshape(5, 2, 32).contiguous(), qkv[:, 128:].view(5, 2, 32)
    cache, scales = torch.zeros(2, 2, 4, 2, 32, dtype=torch.uint8), torch.zeros(2, 2, 4, 2, 1)
    slots = torch.tensor([7, 0, 3, 4, 1])
    cpu_kernels.kv_cache_write(k, v, slots, cache, scales, quant.kind)
    read_k, read_v = kv_quant.read_slots(cache, scales, slots, quant, torch.float32)
    assert torch.equal(read_v, kv_quant.dequantize(*kv_quant.quantize(v, quant), quant, torch.float32))
    assert torch.equal(read_k, kv_quant.dequantize(*kv_quant.quantize(k, quant), quant, torch.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_reads_every_byte_as_torch_does(kind, kernel_isa):
    """Decode attention over one key per byte value (NaN codes left out): with a query that is 1 in
    one lane and V = K, the output is the softmax-weighted K of that lane, as torch dequantizes it."""
    if kernel_isa is None:
        pytest.skip("no C kernels built here")
    quant = kv_quant.kv_quant_for(kind)
    codes = torch.arange(256, dtype=torch.uint8)
    if kind != "int8":
        codes = codes[~codes.view(quant.element).float().isnan()]
    codes = codes[codes.view(quant.element).float().abs() <= quant.qmax]
    d = 32
    n = -(-len(codes) // d) * d
    data = torch.zeros(n, d, dtype=torch.uint8)
    data.view(-1)[: len(codes)] = codes  # key i holds codes i*d .. i*d + d - 1
    cache = data.view(n, 1, 1, d).expand(n, 1, 1, d).contiguous()
    scales = torch.full((n, 1, 1, 1), 0.5)
    q = torch.zeros(d, 1, d)
    for lane in range(d):
        q[lane, 0, lane] = 1.0
    out = cpu_kernels.paged_decode_attention(q, cache, cache, torch.arange(n)[None].expand(d, n).contiguous(),
                                             torch.full((d,), n), None, 1e-3, (scales, scales, quant.kind))
    values = kv_quant.dequantize(data, scales.view(n, 1), quant, torch.float64)
    probs = (values.T * 1e-3).softmax(-1)  # [lane, key]: query lane's scores
    torch.testing.assert_close(out[:, 0].double(), probs @ values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind, rel", [("int8", 1 / 254), ("fp8_e4m3", 1 / 16), ("fp8_e5m2", 1 / 8)])
def test_round_trip_error_is_the_types_rounding(kind, rel):
    quant = kv_quant.kv_quant_for(kind)
    x = _values(16, 2, 64, torch.float32)
    back = kv_quant.dequantize(*kv_quant.quantize(x, quant), quant, torch.float32)
    absmax = x.unflatten(-1, (2, 32)).abs().amax(-1, keepdim=True).expand(-1, -1, -1, 32).flatten(-2)
    if kind == "int8":  # half a step of absmax / 127
        assert ((back - x).abs() <= absmax * rel * 1.0001).all()
    else:  # half an ulp of the value, or of the smallest normal below it
        floor = absmax / quant.qmax * (2.0 ** -6 if kind == "fp8_e4m3" else 2.0 ** -14)
        assert ((back - x).abs() <= torch.maximum(x.abs() * rel, floor) * 1.0001).all()


def test_fp8_is_e4m3_and_unknown_names_are_refused():
    assert kv_quant.kv_quant_for("fp8").name == "fp8_e4m3"
    assert kv_quant.kv_quant_for("auto") is None
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_quant.kv_quant_for("fp4")
