"""Weight-only int8 / int4 and W8A8: quantization error bounds, kernels against a float
reference, and the row-count dispatch of `Linear` / `LMHead`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import cpu_isa
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers import quantization as qz
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.vocab_embedding import LMHead, VocabEmbedding


@pytest.fixture(params=["pagedllm", "torch"])
def layout(request, monkeypatch):
    """Which kernels the weight-only formats are packed for: pagedllm's C ones (torch's where
    they are not built: the layout tests expect), or torch's."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    return "pagedllm" if request.param == "pagedllm" and cpu_kernels.kernels() is not None else "torch"


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def test_int8_roundtrip_within_half_a_step():
    w = _weight(48, 96)
    q, scale = qz.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    err = (qz.dequantize_int8(q, scale) - w).abs()
    assert (err <= scale.float()[:, None] * 0.5 + 1e-6).all()


def test_int4_roundtrip_within_half_a_step():
    w = _weight(48, 96)
    q, sz = qz.quantize_int4(w, 32)
    assert q.min() >= 0 and q.max() <= 15 and sz.shape == (3, 48, 2)
    err = (qz.dequantize_int4(q, sz) - w).abs().view(48, 3, 32)
    step = sz.float().transpose(0, 1)[..., 0]
    # Half a step, plus what the bf16 rounding of the zero point can add.
    assert (err <= step[..., None] * 0.5 + sz.float().transpose(0, 1)[..., 1:].abs() / 256 + 1e-6).all()


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_kernel_matches_dequantized_reference(method, dtype, rows, layout):
    w = _weight(64, 128)
    deq = w.clone()
    quant = qz.quantize_weight(deq, method, max_rows=4)  # `deq` now holds the dequantized weight
    assert (quant.method, quant.layout) == (method, layout)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(64)
    out = quant(x.to(dtype), bias.to(dtype))
    assert out.dtype == dtype and out.shape == (rows, 64)
    ref = F.linear(x.bfloat16().float(), deq, bias)  # torch's kernels see bf16 activations
    torch.testing.assert_close(out.float(), ref, atol=0.03, rtol=0.02)
    # and the quantized layer stays close to the unquantized one
    exact = F.linear(x, w, bias)
    rel = (out.float() - exact).norm() / exact.norm()
    assert rel < (0.1 if method == "int4" else 0.02)


@pytest.mark.parametrize("k", [33, 100])
def test_int8_takes_any_input_width(k, layout):
    """torch's int8 GEMV reads its inputs 8 or 16 at a time with no tail: its layout pads the
    weight with zero columns (W8A8, built from the same format, must not see them)."""
    deq = _weight(48, k)
    quant = qz.quantize_weight(deq, "int8", max_rows=4)
    assert quant.layout == layout
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(quant(x).float(), F.linear(x.bfloat16().float(), deq), atol=0.03, rtol=0.02)
    dyn = qz.DynamicInt8Quant(_weight(48, k))
    torch.testing.assert_close(dyn(x).double(), _dynamic_reference(x, _weight(48, k), dyn), atol=2e-3, rtol=8e-3)


def test_int4_falls_back_to_int8_for_shapes_it_cannot_pack():
    quant = qz.quantize_weight(_weight(40, 64), "int4", 4)  # 40 rows: not a multiple of 16
    assert quant.method == "int8"
    quant = qz.quantize_weight(_weight(32, 48), "int4", 4)  # 48 inputs: no group of 32 fits
    assert quant.method == "int8"


def test_write_back_false_leaves_the_weight_alone():
    w = _weight(32, 64)
    before = w.clone()
    qz.quantize_weight(w, "int4", 4, write_back=False)
    assert torch.equal(w, before)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_chunked_quantization_equals_whole(monkeypatch, method, layout):
    w = _weight(160, 64)  # 64-row slices and a 32-row tail
    whole_w = w.clone()
    whole = qz.quantize_weight(whole_w, method, 4)
    monkeypatch.setattr(qz, "_CHUNK_BYTES", 64 * 64 * 4)
    assert qz.chunk_rows(64) == 64
    chunked_w = w.clone()
    chunked = qz.quantize_weight(chunked_w, method, 4)
    assert whole.layout == chunked.layout == (layout if method == "int8" else "torch")  # int4 g64: torch's
    assert torch.equal(whole.qweight, chunked.qweight) and torch.equal(whole.scales, chunked.scales)
    assert torch.equal(whole_w, chunked_w)


def test_chunked_w8a8_equals_whole(monkeypatch):
    w = _weight(160, 64)
    whole = qz.quantize_int8(w, qz.DynamicInt8Quant.weight_qmax())
    monkeypatch.setattr(qz, "_CHUNK_BYTES", 64 * 64 * 4)
    chunked = qz.DynamicInt8Quant(w).int8_weight()
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_linear_uses_the_kernel_for_few_rows_only(monkeypatch, layout):
    lin = Linear(64, 32, bias=True)
    with torch.no_grad():
        lin.weight.copy_(_weight(32, 64))
        lin.bias.normal_()
        lin.quant = qz.quantize_weight(lin.weight.data, "int8", max_rows=4)
    assert lin.quant.layout == layout
    calls = []
    kernel = qz.WeightOnlyQuant.forward
    monkeypatch.setattr(qz.WeightOnlyQuant, "forward", lambda *a: calls.append(1) or kernel(*a))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    few = lin(x[:2])
    assert len(calls) == 1
    many = lin(x)
    assert len(calls) == 1  # 8 rows > max_rows: bf16/fp32 GEMM on the dequantized weight
    torch.testing.assert_close(few, many[:2], atol=0.03, rtol=0.02)


def test_int4_takes_the_largest_group_that_fits():
    assert qz.int4_group_size(64, 640) == 128
    assert qz.int4_group_size(64, 192) == 64
    assert qz.int4_group_size(64, 96) == 32
    assert qz.int4_group_size(40, 640) is None


def _dynamic_reference(x: torch.Tensor, w: torch.Tensor, dyn: qz.DynamicInt8Quant) -> torch.Tensor:
    """What `dyn` computes for x, in float64: per-channel int8 weight (in ±qmax), times each row
    of x quantized to s8 with its scale (bf16 for oneDNN, float32 for the C kernel)."""
    q, w_scale = qz.quantize_int8(w, dyn.qmax)
    xf = x.float()
    x_scale = (xf.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
    if dyn.runs_kernel:  # as the kernel rounds: x times 127 / max|x| (a true division) in float32
        inv = torch.div(torch.tensor(127.0), xf.abs().amax(-1, keepdim=True))  # `127 / t` is 127 * (1 / t)
        xq = torch.round(xf * inv).double()
        x_scale = x_scale.double()
    else:
        x_scale = x_scale.bfloat16().double()
        xq = torch.round(xf.double() / x_scale)
    return (xq @ q.double().t()) * x_scale * w_scale.double()[None]


@pytest.fixture(params=["onednn", "kernel"])
def dynamic_path(request, monkeypatch) -> str:
    """DynamicInt8Quant as built on a CPU with VNNI (oneDNN's W8A8) and on one without (the C
    u8 x s8 kernel, weights in ±64), whichever this CPU is."""
    kernel = request.param == "kernel"
    if kernel and cpu_kernels.kernels() is None:
        pytest.skip("no C kernels")
    monkeypatch.setattr(qz, "dynamic_runs_kernel", lambda: kernel)
    if not kernel and not cpu_isa.has_vnni():  # weights in ±64, as on such a CPU
        monkeypatch.setattr(qz.DynamicInt8Quant, "weight_qmax", staticmethod(lambda: 64))
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_int8_matches_its_float64_reference(dtype, dynamic_path):
    w = _weight(96, 64)
    dyn = qz.DynamicInt8Quant(w)
    assert dyn.runs_kernel == (dynamic_path == "kernel")
    for rows in (5, 40):
        x = (torch.randn(rows, 64, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
        out = dyn(x)
        assert out.dtype == dtype and out.shape == (rows, 96)
        ref = _dynamic_reference(x, w, dyn)
        # int32 accumulation is exact; what is left is the bf16 output and its rescaling.
        torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=8e-3)
        rel = (out.double() - F.linear(x.double(), w.double())).norm() / ref.norm()
        assert rel < 0.02  # and it stays close to the unquantized layer


def test_dynamic_int8_rows_do_not_depend_on_their_batch(dynamic_path):
    dyn = qz.DynamicInt8Quant(_weight(256, 64))
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    x[5] *= 100  # an outlier row must not change the others' scales
    batch = dyn(x)
    for i in (0, 5, 69):
        assert torch.equal(dyn(x[i : i + 1]), batch[i : i + 1])
    assert torch.equal(dyn(x[:3]), batch[:3])


def _tied_head(dtype):
    emb = VocabEmbedding(512, 64).to(dtype)
    with torch.no_grad():
        emb.weight.copy_(_weight(512, 64))
    return emb, LMHead(512, 64, tied_to=emb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_head_recomputes_its_top_k_exactly(dtype, layout, monkeypatch):
    emb, head = _tied_head(dtype)
    before = emb.weight.detach().clone()
    few_rows = qz.quantize_weight(emb.weight.data, "int4", max_rows=4, write_back=False)
    dynamic = qz.DynamicInt8Quant(emb.weight.data)
    head.quant = qz.QuantizedLMHead(dynamic, few_rows, top_k=40)
    monkeypatch.setattr(qz, "DYNAMIC_TOP_K", 24)
    assert torch.equal(emb.weight, before)  # the embedding is not touched
    picked = []
    select = qz.top_k_indices
    monkeypatch.setattr(qz, "top_k_indices", lambda *a: picked.append(select(*a)) or picked[-1])

    h = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    # up to max_rows int4 ranks (with 8-bit activations: `rank`) and its top 40 are re-scored;
    # above, W8A8 ranks and its top 24
    for rows, ranking, k in ((h[:3], few_rows.rank, 40), (h, dynamic, 24)):
        got, exact, approx = head(rows), F.linear(rows, before), ranking(rows)
        assert got.dtype == dtype
        top = picked[-1]
        assert top.shape == (rows.shape[0], k)
        # a valid top k of the quantized ranking (any order, ties either way) ...
        chosen = torch.zeros_like(got, dtype=torch.bool).scatter_(1, top, True)
        assert (chosen.sum(-1) == k).all()
        worst_in = approx.float().masked_fill(~chosen, float("inf")).amin(-1)
        best_out = approx.float().masked_fill(chosen, float("-inf")).amax(-1)
        assert (worst_in >= best_out).all()
        # ... gets the float head's values; the rest keep the quantized ones.
        torch.testing.assert_close(got.gather(1, top), exact.gather(1, top))
        assert torch.equal(got[~chosen], approx[~chosen])
        assert (got.argmax(-1) == exact.argmax(-1)).all()


def test_int8_head_is_w8a8_at_every_row_count():
    emb, head = _tied_head(torch.bfloat16)
    head.quant = qz.QuantizedLMHead(qz.DynamicInt8Quant(emb.weight.data), None, top_k=0)
    h = torch.randn(9, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert torch.equal(head(h), head.quant.dynamic(h))
    assert torch.equal(head(h[:1]), head(h)[:1])
