"""`pagedllm collect-env`: what a bug report needs (as vLLM's collect-env): versions, OS, the
CPU and the flags pagedllm's kernels use, the compiler, whether the kernels built, CUDA."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from importlib import metadata

from pagedllm import envs

# Distributions whose versions change pagedllm's behaviour, in report order.
PACKAGES = ("torch", "transformers", "tokenizers", "xgrammar", "gguf", "safetensors", "numpy", "fastapi",
            "uvicorn", "pydantic", "msgspec", "pyzmq", "openai")
# /proc/cpuinfo flags the kernels and torch's CPU paths depend on.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16", "amx_int8")


def add_collect_env_parser(subparsers) -> None:
    p = subparsers.add_parser("collect-env", help="print the environment, for a bug report")
    p.set_defaults(func=run_collect_env)


def run_collect_env(args: argparse.Namespace) -> int:
    rows = collect_env()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name.ljust(width)} : {value}")
    return 0


def collect_env() -> list[tuple[str, str]]:
    """(name, value) rows; each value is one line and never raises: a report is most needed
    where something is broken."""
    from pagedllm.version import __version__

    rows = [("pagedllm", __version__), ("Python", sys.version.replace("\n", " "))]
    rows += [(name, _version(name)) for name in PACKAGES]
    rows += [
        ("OS", f"{platform.platform()} ({' '.join(platform.libc_ver()).strip() or 'libc unknown'})"),
        ("CPU model", _cpu_model()),
        ("CPU flags", _cpu_flags()),
        ("CPU cores", _cores()),
        ("CPU ISA", _guard(_cpu_isa)),
        ("Compiler", _compiler()),
        ("C kernels", _guard(_kernels)),
        ("CUDA", _guard(_cuda)),
    ]
    env = [f"{k}={v}" for k, v in envs.pagedllm_settings().items() if "KEY" not in k]
    rows.append(("PAGEDLLM_* variables", " ".join(env) or "none set"))
    return rows


def _guard(fn) -> str:
    try:
        return fn()
    except Exception as e:  # the report says what failed instead of dying
        return f"error: {type(e).__name__}: {e}"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() == name:
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def _cpu_flags() -> str:
    flags = set((_cpuinfo_field("flags") or "").split())
    if not flags:
        return f"unknown ({platform.machine()}, no /proc/cpuinfo flags)"
    return " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in CPU_FLAGS)


def _cores() -> str:
    import psutil

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{os.cpu_count()} logical, {psutil.cpu_count(logical=False)} physical, {usable} usable by this "
            f"process; torch threads {_torch().get_num_threads()}")


def _cpu_isa() -> str:
    from pagedllm import cpu_isa

    asked = envs.PAGEDLLM_CPU_ISA or None
    return (f"{cpu_isa.selected()} (CPU: {cpu_isa.detected()}; {cpu_isa.ENV}={asked or 'unset'}; "
            f"torch: {_torch().backends.cpu.get_cpu_capability()})")


def _compiler() -> str:
    cc = envs.CC
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cc}: not usable ({e})"
    return out.splitlines()[0] if out else f"{cc}: no version output"


def _kernels() -> str:
    """Builds them where they are not cached yet (~2 s), as the engine's first use would."""
    from pagedllm import cpu_isa
    from pagedllm.model_executor.layers import cpu_kernels

    if not envs.PAGEDLLM_CPU_KERNELS:
        return "off (PAGEDLLM_CPU_KERNELS=0): torch ops"
    isa = cpu_kernels.loaded_isa()
    if isa is None:
        return f"not built (CPU ISA {cpu_isa.selected()}): torch ops; the log line above says why"
    return f"{cpu_kernels.describe(isa)} path: {getattr(cpu_kernels.kernels(), '_name', '?')}"


def _cuda() -> str:
    torch = _torch()
    if torch.version.cuda is None:
        return "none (CPU build of torch)"
    if not torch.cuda.is_available():
        return f"torch built with CUDA {torch.version.cuda}; no device available"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return f"CUDA {torch.version.cuda}, driver-visible devices: {names}"


def _torch():
    import torch

    return torch
