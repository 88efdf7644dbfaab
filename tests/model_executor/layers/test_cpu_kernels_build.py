"""Building and loading pagedllm's C kernels: cached by source, flags and CPU; and where they
cannot be built (no compiler, turned off), `kernels()` is None and the layers use torch."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An unloaded library and an empty cache directory."""
    monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernels._UNSET)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    return tmp_path / "cpu_kernels"


def test_turned_off_or_no_compiler_means_torch_paths(fresh, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert cpu_kernels.kernels() is None
    monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernels._UNSET)
    monkeypatch.delenv("PAGEDLLM_CPU_KERNELS")
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    assert cpu_kernels.kernels() is None
    assert not fresh.exists() or not list(fresh.glob("*.so"))  # nothing half-built left behind
    norm = GemmaRMSNorm(32)
    x = torch.randn(3, 32)
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_built_once_then_loaded_from_the_cache(fresh, monkeypatch):
    if cpu_kernels.kernels() is None:
        pytest.skip("pagedllm's CPU kernels cannot be built here")
    (built,) = fresh.glob("cpu_kernels-*.so")
    stamp = built.stat().st_mtime_ns
    monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernels._UNSET)
    assert cpu_kernels.kernels() is not None
    assert list(fresh.glob("cpu_kernels-*.so")) == [built] and built.stat().st_mtime_ns == stamp
    # other flags are another build, which replaces the old one in the cache
    monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernels._UNSET)
    monkeypatch.setenv("PAGEDLLM_KERNEL_CFLAGS", "-DPAGEDLLM_TEST_FLAG")
    assert cpu_kernels.kernels() is not None
    (rebuilt,) = fresh.glob("cpu_kernels-*.so")
    assert rebuilt != built
