"""PAGEDLLM_CPU_ISA: the level pagedllm runs at, capped to the CPU's, and what a cap does to
torch and to pagedllm's own choices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm import cpu_isa

AVX512_FLAGS = frozenset("fma avx2 avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16".split())


@pytest.fixture
def cpu(monkeypatch):
    """Pretends to be an x86 CPU with the given flags."""
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(cpu_isa.ENV, raising=False)

    def set_flags(flags):
        monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(flags))

    return set_flags


def test_levels_follow_the_flags(cpu):
    cpu(AVX512_FLAGS)
    assert cpu_isa.detected() == "avx512" and cpu_isa.has_native_bf16() and cpu_isa.has_vnni()
    cpu({"fma", "avx2", "avx512f"})  # AVX-512 F alone is not the level
    assert cpu_isa.detected() == "avx2" and not cpu_isa.has_native_bf16() and not cpu_isa.has_vnni()
    cpu({"fma", "avx2", "avx_vnni"})
    assert cpu_isa.detected() == "avx2" and cpu_isa.has_vnni()
    cpu({"sse4_2", "avx"})
    assert cpu_isa.detected() == "generic"


@pytest.mark.parametrize(
    "value, level", [(None, "avx512"), ("", "avx512"), ("auto", "avx512"), ("none", "avx512"), ("AVX2", "avx2"),
                     ("generic", "generic"), ("avx512", "avx512")],
)
def test_the_variable_caps_the_level(cpu, monkeypatch, value, level):
    cpu(AVX512_FLAGS)
    if value is not None:
        monkeypatch.setenv(cpu_isa.ENV, value)
    assert cpu_isa.selected() == level and cpu_isa.capped() == (level != "avx512")
    # a cap hides bf16 and VNNI: oneDNN is capped below them
    assert cpu_isa.has_native_bf16() == cpu_isa.has_vnni() == (level == "avx512")


def test_a_level_above_the_cpu_is_capped_to_it_and_a_bad_value_is_an_error(cpu, monkeypatch):
    cpu({"fma", "avx2"})
    monkeypatch.setenv(cpu_isa.ENV, "avx512")
    assert cpu_isa.selected() == "avx2" and not cpu_isa.capped()
    monkeypatch.setenv(cpu_isa.ENV, "avx3")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA='avx3'"):
        cpu_isa.selected()


_PROBE = """
import json, torch, pagedllm
from pagedllm.config import cpu_has_native_bf16
from pagedllm.model_executor.layers import cpu_gemm, cpu_kernels
from pagedllm.model_executor.layers.quantization import DynamicInt8Quant
print(json.dumps({
    "aten": torch.backends.cpu.get_cpu_capability(),
    "pack_bf16": cpu_gemm.can_pack(torch.zeros(16, 16, dtype=torch.bfloat16)),
    "native_bf16": cpu_has_native_bf16(),
    "kernels": getattr(cpu_kernels.kernels(), "pl_isa", None),
    "w8a8": [str(DynamicInt8Quant(torch.randn(16, 64)).out_dtype), DynamicInt8Quant(torch.randn(16, 64)).qmax],
}))
"""


@pytest.mark.skipif(cpu_isa.detected() == "generic", reason="needs an x86 CPU with AVX2")
def test_avx2_runs_as_on_an_avx2_cpu(tmp_path):
    """In a fresh process, torch imported first (no op run yet): on an AVX-512 CPU the cap
    reaches torch and pagedllm (its kernels' AVX2 build); on an AVX2 one it is what the CPU
    does anyway."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA")}
    # -O0: a fresh build of the AVX2 kernels in seconds (their flags and ISA are what is checked)
    env.update(PAGEDLLM_CPU_ISA="avx2", PAGEDLLM_CACHE_DIR=str(tmp_path), PAGEDLLM_KERNEL_CFLAGS="-O0")
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "aten": "AVX2", "pack_bf16": False, "native_bf16": False, "kernels": "avx2",
        # without VNNI the W8A8 head runs the C u8 x s8 kernel (built here), weights in ±64
        "w8a8": ["torch.float32", 64],
    }
    (built,) = tmp_path.glob("cpu_kernels/*.so")  # the AVX2 build, never the CPU's own
    assert built.name.startswith("cpu_kernels-avx2-")
