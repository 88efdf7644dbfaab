"""oneDNN-packed linear weights: same results as F.linear, and applied to a loaded CPU model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers.cpu_gemm import can_pack, pack_weight, packed_linear
from pagedllm.model_executor.layers.linear import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_linear_matches_f_linear(dtype, rows):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 40, generator=g).to(dtype)
    assert can_pack(w)
    out = packed_linear(x, pack_weight(w), b)
    if dtype == torch.bfloat16:
        assert torch.equal(out, F.linear(x, w, b))  # bit-identical
    else:
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_loaded_cpu_model_runs_packed_weights(llm):
    model = llm.llm_engine.engine_core.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    assert model.lm_head.packed is not None
