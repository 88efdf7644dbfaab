"""pagedllm's C kernels against float64 references: int8 / int4 weight-only GEMMs (odd
shapes, bias, both float dtypes) and their row independence. Attention and RMSNorm are
tested through their layers (test_attention.py, test_layernorm.py). Every test runs once per
instruction-set build the CPU can run (conftest.py's `kernel_isa`).

Where the kernels are not built (no gcc), each test runs the torch path the engine takes
there on the same inputs, checks that it did, and holds it to what torch's kernels promise
(bf16 activations; no exact zeros from saturated gates)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers import quantization as qz
from pagedllm.model_executor.layers.activation import get_act_and_mul
from pagedllm.model_executor.layers.sampler import top_k_indices

KERNELS = cpu_kernels.kernels() is not None
pytestmark = pytest.mark.usefixtures("kernel_isa")


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _check(out, ref, dtype):
    """Activations run at ~15 bits: float32 output is within 1e-4 of the float64 result;
    bf16 output (and torch's kernels' output, from bf16 activations) within its own rounding."""
    rel = (out.double() - ref).abs().max() / ref.abs().max()
    assert rel < (1e-4 if dtype == torch.float32 and KERNELS else 8e-3), rel


def _gemv(method, w, x, bias, group=0):
    """x @ (w quantized)^T + bias: pagedllm's kernel where it is built (called directly: any
    shape); elsewhere the layer the engine makes of w, which must run torch's kernels (int8 for
    shapes their int4 packing cannot take). Returns (out, the dequantized weight, x as the
    kernel reads it), both in float64."""
    if not KERNELS:
        deq = w.clone()
        quant = qz.quantize_weight(deq, method, max_rows=x.shape[0])  # deq: the dequantized weight
        assert quant.layout == "torch"
        return quant(x, bias), deq.double(), x.bfloat16().double()
    if method == "int8":
        q, scale = qz.quantize_int8(w)
        return cpu_kernels.w8a16_linear(x, q, scale, bias), qz.dequantize_int8(q, scale).double(), x.double()
    q, sz = qz.quantize_int4(w, group)
    packed, scales = cpu_kernels.pack_int4(q, sz)
    assert packed.shape == (w.shape[0], w.shape[1] // 2) and packed.dtype == torch.uint8
    return cpu_kernels.w4a16_linear(x, packed, scales, group, bias), qz.dequantize_int4(q, sz).double(), x.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(37, 100), (64, 640), (6, 33), (130, 4100)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 35])  # 35: three blocks of activation rows
def test_w8a16_linear(n, k, rows, dtype):
    w = _rand(n, k, scale=0.05)
    x, bias = _rand(rows, k, seed=1).to(dtype), _rand(n, seed=2).to(dtype)
    out, deq, xd = _gemv("int8", w, x, bias)
    assert out.shape == (rows, n) and out.dtype == dtype
    _check(out, xd @ deq.T + bias.double(), dtype)
    _check(_gemv("int8", w, x, None)[0], xd @ deq.T, dtype)


@pytest.mark.skipif(not KERNELS, reason="no C kernels: DynamicInt8Quant runs oneDNN's GEMM")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(37, 100), (64, 640), (17, 33), (130, 4100)])  # odd weight rows, k % 32
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 35, 70])  # 35, 70: more than one block of activation rows
def test_u8s8_rank_is_exact_integer_arithmetic(n, k, rows, dtype):
    """The ranking kernel against its own arithmetic: each row quantized to s8 (x times 127 /
    max|x|, rounded to even), int64 dot products with the weight in ±64, then the row's and the
    weight row's scales. The integer part is exact in every build, so only the output's rounding
    (float32, or bf16) is left."""
    q = torch.randint(-64, 65, (n, k), generator=torch.Generator().manual_seed(4)).to(torch.int8)
    scales = (_rand(n, seed=5).abs() * 0.01 + 1e-3).bfloat16()
    x = (_rand(rows, k, seed=6) * 3).to(dtype)
    x[0, :5] = torch.tensor([1.0, -0.5, 0.5, 0.25, -1.0]).to(dtype)  # max|x| = 1: exact ties at +-63.5
    out = cpu_kernels.u8s8_rank(x, q, scales, q.sum(1, dtype=torch.int32))
    assert out.shape == (rows, n) and out.dtype == dtype
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    xq = torch.round(xf * torch.div(torch.tensor(127.0), amax)).to(torch.int64)  # `127 / t` is 127 * (1 / t)
    want = (xq @ q.to(torch.int64).T).float() * (amax / 127) * scales.float()
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=0)
    else:
        torch.testing.assert_close(out, want.to(dtype), rtol=2**-8, atol=0)


@pytest.mark.skipif(not KERNELS, reason="no C kernels")
@pytest.mark.parametrize("n, k", [(1, 1), (37, 100), (130, 4100), (3, 70000)])
def test_i8_row_sums(n, k):
    q = torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(n)).to(torch.int8)
    q[0, :] = -128  # the most negative row: -128 * k
    assert torch.equal(cpu_kernels.i8_row_sums(q), q.sum(1, dtype=torch.int32))
    assert torch.equal(cpu_kernels.i8_row_sums(q.t()), q.t().sum(1, dtype=torch.int32))  # a strided view
    with pytest.raises(ValueError, match="int8"):
        cpu_kernels.i8_row_sums(q.to(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, group", [(48, 640, 128), (5, 256, 256), (33, 1024, 128)])
@pytest.mark.parametrize("rows", [1, 3, 4, 6])
def test_w4a16_linear(n, k, group, rows, dtype):
    x, bias = _rand(rows, k, seed=1).to(dtype), _rand(n, seed=2).to(dtype)
    out, deq, xd = _gemv("int4", _rand(n, k, scale=0.05), x, bias, group)
    assert out.shape == (rows, n) and out.dtype == dtype
    _check(out, xd @ deq.T + bias.double(), dtype)


@pytest.mark.skipif(not KERNELS, reason="the 8-bit ranking is one of pagedllm's kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, group", [(48, 640, 128), (13, 256, 256), (35, 1024, 128)])  # 13, 35: a partial 8
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6])
def test_w4a8_rank_is_its_own_arithmetic(n, k, group, rows, dtype):
    """The LM head's int4 ranking with 8-bit activations: each row rounded to x * 127 / max|x|,
    times the dequantized int4 weight, then max|x| / 127; each row the same alone as in a batch."""
    q, sz = qz.quantize_int4(_rand(n, k, scale=0.05), group)
    packed, scales = cpu_kernels.pack_int4(q, sz)
    x = (_rand(rows, k, seed=6) * 3).to(dtype)
    out = cpu_kernels.w4a8_rank(x, packed, scales, group)
    assert out.shape == (rows, n) and out.dtype == dtype
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    xq = torch.round(xf * torch.div(torch.tensor(127.0), amax))  # as the kernel: x * (127 / max|x|) in float32
    ref = xq.double() @ qz.dequantize_int4(q, sz).double().T * (amax.double() / 127)
    rel = (out.double() - ref).abs().max() / ref.abs().max()
    assert rel < (1e-5 if dtype == torch.float32 else 8e-3), rel
    for r in range(rows):  # row independence, bit for bit
        assert torch.equal(cpu_kernels.w4a8_rank(x[r : r + 1], packed, scales, group)[0], out[r])
        assert torch.equal(cpu_kernels.w4a16_linear(x[r : r + 1], packed, scales, group, None)[0],
                           cpu_kernels.w4a16_linear(x, packed, scales, group, None)[r])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_extreme_activations(method):
    """Rows of zeros, one huge outlier, and values at the int16 split boundaries."""
    x = _rand(4, 256, seed=3)
    x[0] = 0
    x[1, 7] = 1e4
    x[2] = torch.linspace(-1, 1, 256)
    x[3] = -x[3].abs()
    out, deq, xd = _gemv(method, _rand(16, 256, scale=0.05), x, None, 128)
    assert (out[0] == 0).all()
    ref = xd @ deq.T
    for i in (2, 3):
        _check(out[i], ref[i], torch.float32)
    if KERNELS:
        # The outlier sets row 1's step (1e4 / 32767): its other inputs keep ~2 digits. The
        # bound: half a step per input, times the weights' magnitudes.
        bound = (deq.abs().sum(1) * 1e4 / 32767 / 2).max()
        assert (out[1].double() - ref[1]).abs().max() <= bound
    else:  # torch's kernels take the row in bf16, outlier and all
        _check(out[1], ref[1], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 2176: past one int8 chunk; 100 and 2180: a partial last step (and chunk)
@pytest.mark.parametrize("n, k", [(96, 256), (101, 640), (13, 2176), (37, 100), (40, 2180)])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_rows_do_not_depend_on_their_batch(method, n, k, dtype):
    """Each activation row is quantized alone and accumulated alone: bit-identical results
    whatever else is in the call (a lone row takes the batch-1 fast paths; with AVX2, 16 rows
    or more take the int8 tiles, fewer the general path)."""
    w = _rand(n, k, scale=0.05)
    quant = qz.quantize_weight(w, method, max_rows=8, write_back=False)
    assert quant.layout == ("pagedllm" if KERNELS else "torch")
    x = _rand(20, k, seed=4).to(dtype)  # more rows than one int8 block of activation rows
    x[3] *= 50
    for bias in (None, _rand(n, seed=5).to(dtype)):
        batch = quant(x, bias)
        for i in (0, 1, 3, 6, 15, 16, 19):
            assert torch.equal(quant(x[i : i + 1], bias), batch[i : i + 1])
        assert torch.equal(quant(x[2:6], bias), batch[2:6])
        assert torch.equal(quant(x[2:19], bias), batch[2:19])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(262144, 256), (1000, 1), (1000, 999), (37, 37), (300, 20)])
def test_topk_indices(n, k, dtype, monkeypatch):
    x = (_rand(5, n, seed=5) * 3).to(dtype)
    x[1, :] = 1.0  # all tied
    x[2, -k:] = 100.0  # the best at the very end
    calls = []
    kernel = cpu_kernels.topk_indices
    monkeypatch.setattr(cpu_kernels, "topk_indices", lambda *a: calls.append(1) or kernel(*a))
    idx = top_k_indices(x, k)  # the kernel, or torch.topk where it is not built
    assert len(calls) == KERNELS and idx.shape == (5, k)
    for row, ids in zip(x.float(), idx):
        assert len(set(ids.tolist())) == k
        assert torch.equal(row[ids].sort(descending=True).values, row.topk(k).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_and_mul(act, dtype, monkeypatch):
    """One rounding at the end, so at least as close to float64 as torch's two-op version;
    saturated gates (±100, ±200) give exact zeros and their linear parts, not NaN. Where the
    kernel is not built, torch's version: two roundings, and it cancels 0.5 g (1 + tanh t) for
    very negative g (tiny values, only absolutely close)."""
    x = (_rand(7, 2 * 100, seed=6) * 3).to(dtype)  # 100: a 16-lane tail
    x[0, :12] = torch.tensor([0, -100, 100, 1e-8, -1e-8, 20, -20, 8, -8, 0.5, -200, 200]).to(dtype)
    gate, up = x.double().chunk(2, dim=-1)
    # gelu_tanh as g * sigmoid(2t), which equals 0.5 g (1 + tanh t) but, unlike it, does not
    # cancel to 0 in float64 for very negative g
    k = (2 / torch.pi) ** 0.5
    fn = F.silu if act == "silu" else lambda g: g * torch.sigmoid(2 * k * (g + 0.044715 * g**3))
    ref = fn(gate) * up
    calls = []
    kernel = cpu_kernels.act_and_mul
    monkeypatch.setattr(cpu_kernels, "act_and_mul", lambda *a: calls.append(1) or kernel(*a))
    got = get_act_and_mul(act)(x)
    assert len(calls) == KERNELS
    assert got.shape == (7, 100) and got.dtype == dtype and torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2**-8 if KERNELS else 2**-7
    assert ((got.double() - ref).abs() <= tol * ref.abs() + (1e-30 if KERNELS else 1e-6)).all()
    if KERNELS:
        assert (got[0, [1, 10]] == 0).all()


def test_nonfinite_activations_give_nan_rows():
    """A row with inf or NaN must not come out finite (or with flipped infinities): its row is
    NaN, the others are untouched."""
    x = _rand(3, 128, seed=7)
    x[0, 5], x[2, 9] = float("nan"), float("inf")
    for method in ("int8", "int4"):
        out = _gemv(method, _rand(16, 128, scale=0.05), x, None, 128)[0]
        if KERNELS:
            assert out[0].isnan().all() and out[2].isnan().all()
        else:  # torch's: NaN, and an infinity of each weight's sign
            assert out[0].isnan().all() and not torch.isfinite(out[2]).any()
        assert torch.isfinite(out[1]).all()


def test_float16_runs_through_the_kernel_layout():
    """float16 models: pagedllm's int4 / int8 layouts run in bf16 and come back in float16."""
    w = _rand(64, 256, scale=0.05)
    x = _rand(3, 256, seed=8).half()
    for method in ("int8", "int4"):
        deq = w.clone()
        quant = qz.quantize_weight(deq, method, max_rows=8)  # deq: the dequantized weight
        assert quant.layout == ("pagedllm" if KERNELS else "torch")
        out = quant(x, torch.zeros(64, dtype=torch.float16))
        assert out.dtype == torch.float16
        ref = x.double() @ deq.double().T
        assert ((out.double() - ref).norm() / ref.norm()) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary_dim, norm", [(256, 256, "gemma"), (64, 64, "llama"), (96, 32, None)])
def test_qk_norm_rope_matches_the_torch_path(head_dim, rotary_dim, norm, dtype, monkeypatch):
    """The fused q/k norm + rotary against the separate torch ops it replaces (float32: to
    rounding). In bf16 the two round at different points, and q*cos + rot(q)*sin may cancel to
    a value far smaller than its terms: the difference stays within a bf16 step of the value
    plus one of the head's largest value (which bounds the terms)."""
    from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    rope = RotaryEmbedding(inv_freq, 512)
    heads, kv_heads, tokens = 4, 2, 7
    norms = (None, None)
    if norm is not None:
        cls = GemmaRMSNorm if norm == "gemma" else RMSNorm
        norms = tuple(cls(head_dim).to(dtype) for _ in range(2))
        with torch.no_grad():
            for i, n in enumerate(norms):
                n.weight.copy_(_rand(head_dim, seed=20 + i))
    qkv = (_rand(tokens, (heads + 2 * kv_heads) * head_dim + 16, seed=9) * 2).to(dtype)[:, 16:]  # strided rows
    positions = torch.tensor([0, 1, 5, 17, 100, 311, 511])
    calls = []
    fused = cpu_kernels.qk_norm_rope
    monkeypatch.setattr(cpu_kernels, "qk_norm_rope", lambda *a: calls.append(1) or fused(*a))
    with torch.no_grad():
        got = rope.forward_qkv(positions, qkv, heads, kv_heads, head_dim, *norms)
        assert calls == [1] * KERNELS
        rope._last = None
        monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
        want = rope.forward_qkv(positions, qkv, heads, kv_heads, head_dim, *norms)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        else:
            w = w.float()
            head_scale = w.abs().amax(dim=-1, keepdim=True)
            assert ((g.float() - w).abs() <= 2**-6 * (w.abs() + head_scale)).all()
