"""The x86 instruction set pagedllm's CPU paths use: what the CPU has, or less if
`PAGEDLLM_CPU_ISA` asks for less, so that an AVX-512 machine runs (and tests) exactly the paths
an AVX2-only machine runs.

Levels, lowest first: "generic" (no AVX2, or not x86), "avx2" (AVX2 + FMA), "avx512"
(AVX-512 F, BW, VL and DQ). `PAGEDLLM_CPU_ISA` unset, "", "auto" or "none": the CPU's level;
"avx2" / "generic": at most that level (a level above the CPU's is capped to the CPU's).
Below the CPU's level:
- pagedllm's C kernels are built for the lower level (`cpu_kernels.py`: the AVX2 + FMA or the
  portable C build), so an AVX-512 machine runs the code an AVX2-only one does;
- torch is capped as well, before its first CPU op (`apply`): `ATEN_CPU_CAPABILITY` for ATen's
  vectorised kernels and `DNNL_MAX_CPU_ISA` for oneDNN's GEMMs, which then has no bf16 support,
  as on a CPU without AVX-512 (variables already set are left alone);
- the CPU counts as one without native bf16 (`--dtype auto` picks float32).

Kept free of torch imports: `apply` must run before torch does anything.
"""

from __future__ import annotations

import platform
import sys
import warnings

from pagedllm import envs

ENV = "PAGEDLLM_CPU_ISA"
LEVELS = ("generic", "avx2", "avx512")
_DETECT = ("", "auto", "none")
# What each level caps torch to: (ATEN_CPU_CAPABILITY, DNNL_MAX_CPU_ISA).
_TORCH_CAPS = {"generic": ("default", "SSE41"), "avx2": ("avx2", "AVX2")}
_REQUIRED = {"avx2": ("avx2", "fma"), "avx512": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq")}

_flags: frozenset[str] | None = None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    global _flags
    if _flags is None:
        try:
            with open("/proc/cpuinfo") as f:
                line = next((line for line in f if line.startswith("flags")), "")
        except OSError:
            line = ""
        _flags = frozenset(line.partition(":")[2].split())
    return _flags


def detected() -> str:
    """The highest level this CPU has."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    flags = cpu_flags()
    return next((lvl for lvl in reversed(LEVELS[1:]) if all(f in flags for f in _REQUIRED[lvl])), "generic")


def requested() -> str | None:
    """The level `PAGEDLLM_CPU_ISA` asks for, or None for the CPU's own."""
    value = envs.PAGEDLLM_CPU_ISA.strip().lower()
    if value in _DETECT:
        return None
    if value not in LEVELS:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(LEVELS)} or auto")
    return value


def selected() -> str:
    """The level pagedllm runs at: the CPU's, capped by `PAGEDLLM_CPU_ISA`."""
    cpu, asked = detected(), requested()
    return cpu if asked is None else LEVELS[min(LEVELS.index(cpu), LEVELS.index(asked))]


def capped() -> bool:
    """Whether `PAGEDLLM_CPU_ISA` holds this CPU below its own level."""
    return selected() != detected()


def has_native_bf16() -> bool:
    """Whether bf16 GEMMs run on bf16 hardware here (AVX512-BF16 or AMX), at the selected level."""
    return selected() == "avx512" and not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def has_vnni() -> bool:
    """Whether int8 dot products run on VNNI here (AVX512-VNNI, AVX-VNNI or AMX) at the selected
    level; without it oneDNN's u8 x s8 GEMMs add pairs of products in saturating int16. A cap
    hides them: DNNL_MAX_CPU_ISA=AVX2 is AVX2 without VNNI."""
    return not capped() and not cpu_flags().isdisjoint({"avx512_vnni", "avx_vnni", "amx_int8"})


def apply() -> None:
    """Caps torch's CPU kernels to the selected level. It must run before torch's first CPU op
    (both libraries read their variable once); pagedllm's `__init__` runs it first thing."""
    if not capped():
        return
    aten, dnnl = _TORCH_CAPS[selected()]
    envs.set_default("ATEN_CPU_CAPABILITY", aten)
    envs.set_default("DNNL_MAX_CPU_ISA", dnnl)
    if "torch" in sys.modules:  # imported before pagedllm: it may have fixed its choice already
        import torch

        if torch.backends.cpu.get_cpu_capability().lower() != envs.ATEN_CPU_CAPABILITY.lower():
            warnings.warn(
                f"{ENV}={selected()}: torch already chose {torch.backends.cpu.get_cpu_capability()}; "
                "set the variable before torch runs, or ATEN_CPU_CAPABILITY / DNNL_MAX_CPU_ISA yourself",
                stacklevel=2,
            )
