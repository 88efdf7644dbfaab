"""Our RMSNorms against transformers' (Llama and Gemma 3 flavours): bit-identical through
torch's ops; within float32 rounding (a different summation order) through the C kernel. The
kernel tests run the torch path where the kernels are not built, and check which one ran."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

CLASSES = [(RMSNorm, LlamaRMSNorm), (GemmaRMSNorm, Gemma3RMSNorm)]


@pytest.fixture
def kernel_calls(monkeypatch, kernel_isa):
    """The calls made to the C RMSNorm (each build this CPU runs), and whether one is built."""
    calls = []
    kernel = cpu_kernels.rms_norm
    monkeypatch.setattr(cpu_kernels, "rms_norm", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    return calls, cpu_kernels.kernels() is not None


def _pair(ours_cls, ref_cls, dim, dtype):
    ours, ref = ours_cls(dim, 1e-6).to(dtype), ref_cls(dim, 1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    return ours, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ours_cls, ref_cls", CLASSES)
def test_torch_path_is_bit_identical(ours_cls, ref_cls, dtype, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    torch.manual_seed(0)
    x = torch.randn(37, 64, dtype=dtype) * 3
    ours, ref = _pair(ours_cls, ref_cls, 64, dtype)
    assert torch.equal(ours(x), ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ours_cls, ref_cls", CLASSES)
@pytest.mark.parametrize("dim", [64, 100, 640])
def test_kernel_path_matches(ours_cls, ref_cls, dtype, dim, kernel_calls):
    torch.manual_seed(0)
    ours, ref = _pair(ours_cls, ref_cls, dim, dtype)
    x = torch.randn(37, dim, dtype=dtype) * 3
    # a strided [tokens, heads, dim] view, as q_norm gets from the fused qkv output
    wide = torch.randn(5, 3 * dim + 7, dtype=dtype)
    heads = wide[:, 7:].view(5, 3, dim)
    with torch.no_grad():
        for inp in (x, heads):
            got, want = ours(inp), ref(inp)
            assert got.shape == want.shape and got.is_contiguous()
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
            else:  # at most one bf16 rounding step apart
                diff = (got.float() - want.float()).abs()
                assert (diff <= want.float().abs() * 2**-7 + 1e-6).all()
                assert (got != want).float().mean() < 0.01
    calls, built = kernel_calls
    assert len(calls) == (2 if built else 0)


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_with_residual(dtype, use_kernel, monkeypatch, kernel_calls):
    """norm(x, residual=r) is r + norm(x), with the norm rounded to the dtype first."""
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    torch.manual_seed(1)
    norm = GemmaRMSNorm(640).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        x, r = torch.randn(9, 640, dtype=dtype), torch.randn(9, 640, dtype=dtype)
        assert torch.equal(norm(x, residual=r), r + norm(x))
    calls, built = kernel_calls
    assert len(calls) == (2 if use_kernel and built else 0)


@pytest.mark.parametrize("shape", [(640,), (2, 3, 5, 640)])
def test_any_leading_shape(shape):
    norm = GemmaRMSNorm(640)
    x = torch.randn(*shape)
    out = norm(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
