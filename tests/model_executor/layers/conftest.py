"""`kernel_isa`: runs a test once per instruction-set build of pagedllm's C kernels this CPU can
run (AVX-512, AVX2 + FMA, portable C; PAGEDLLM_CPU_ISA caps the list), so an AVX-512 machine
tests the AVX2 and portable paths too. Where no build is possible (no compiler), once, with
the torch paths."""

from __future__ import annotations

import pytest

from pagedllm.model_executor.layers import cpu_kernels


def kernel_levels() -> list[str | None]:
    return cpu_kernels.runnable_isas() if cpu_kernels.kernels() is not None else [None]


@pytest.fixture(params=kernel_levels())
def kernel_isa(request, monkeypatch) -> str | None:
    if request.param is not None:
        monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernels.load(request.param))
    return request.param
