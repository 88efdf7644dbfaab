"""Our RMSNorms are bit-identical to transformers' (Llama and Gemma 3 flavours)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ours_cls, ref_cls", [(RMSNorm, LlamaRMSNorm), (GemmaRMSNorm, Gemma3RMSNorm)])
def test_rms_norm_matches_transformers(ours_cls, ref_cls, dtype):
    torch.manual_seed(0)
    x = torch.randn(37, 64, dtype=dtype) * 3
    ours, ref = ours_cls(64, 1e-6).to(dtype), ref_cls(64, 1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    assert torch.equal(ours(x), ref(x))
