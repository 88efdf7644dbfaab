"""Building and loading pagedllm's C kernels: one build per instruction set level, with that
level's flags; cached by source, flags, CPU and level; and where they cannot be built (no
compiler, a failing one, turned off), `kernels()` is None and the layers use torch."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import time

import pytest
import torch

from pagedllm import cpu_isa
from pagedllm.cache_files import current_umask
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An unloaded library and an empty cache directory."""
    monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernels._UNSET)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "cpu_kernels"


def _reload(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernels._UNSET)
    return cpu_kernels.kernels()


def _recording_cc(tmp_path):
    """gcc, logging each call to the returned log file."""
    script, log = tmp_path / "recording-cc", tmp_path / "cc.log"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec gcc "$@"\n')
    script.chmod(0o755)
    return script, log


def test_turned_off_or_failing_compiler_means_torch_paths(fresh, monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_isa, "selected", lambda: "avx512")  # a level that tries to build
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert cpu_kernels.kernels() is None
    monkeypatch.delenv("PAGEDLLM_CPU_KERNELS")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert _reload(monkeypatch) is None
    broken = tmp_path / "broken-cc"  # answers --version, then fails to compile
    broken.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "broken 1.0" && exit 0\necho error >&2\nexit 1\n')
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    assert _reload(monkeypatch) is None
    assert fresh.is_dir() and [p.name for p in fresh.iterdir()] == [".build.lock"]  # nothing half-built
    norm = GemmaRMSNorm(32)
    x = torch.randn(3, 32)
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="no C compiler")
@pytest.mark.parametrize("level", ["avx2", "generic"])
def test_each_level_builds_with_its_own_flags(level, fresh, monkeypatch, tmp_path):
    """An AVX2-only CPU, or PAGEDLLM_CPU_ISA capping an AVX-512 one: the kernels are built for
    that level, without a single AVX-512 flag (nor -march=native, which would bring them)."""
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", level)
    monkeypatch.setenv("PAGEDLLM_KERNEL_CFLAGS", "-O0")  # after -O3: the flags are tested, not the code's speed
    cc, log = _recording_cc(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    if cpu_isa.detected() == "generic" and level == "avx2":
        pytest.skip("this CPU has no AVX2")
    lib = cpu_kernels.kernels()
    assert cpu_isa.selected() == level and lib is not None and lib.pl_isa == level
    (built,) = fresh.glob("*.so")
    assert built.name.startswith(f"cpu_kernels-{level}-")
    lines = [line for line in log.read_text().splitlines() if "--version" not in line]
    assert len([line for line in lines if " -c " not in line]) == 1  # one link, after a compile per source
    for line in lines:
        assert "avx512" not in line and "-march" not in line
        assert ("-mavx2" in line) == (level == "avx2")
    # it runs: one RMSNorm through the level's build
    x = torch.randn(3, 40)
    out = GemmaRMSNorm(40)(x)
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_levels_and_their_paths(monkeypatch):
    """What `collect-env` and the start-up log name: the level and its extensions."""
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni"}))
    monkeypatch.setattr(cpu_isa, "capped", lambda: False)
    assert cpu_kernels.describe("avx512") == "AVX-512 (VNNI)"
    assert cpu_kernels.describe("avx2") == "AVX2+FMA (AVX-VNNI)"
    assert cpu_kernels.describe("generic") == "portable C"
    monkeypatch.setattr(cpu_isa, "capped", lambda: True)  # PAGEDLLM_CPU_ISA=avx2 on this CPU
    assert cpu_kernels.describe("avx2") == "AVX2+FMA"
    monkeypatch.setattr(cpu_isa, "selected", lambda: "avx2")
    assert cpu_kernels.runnable_isas() == ["avx2", "generic"]
    with pytest.raises(ValueError, match="no kernels"):
        cpu_kernels.isa_flags("sse9")


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="no C compiler")
def test_background_build_then_kernels_compiles_once(fresh, monkeypatch, tmp_path):
    """The engine starts the build while the model converts; `kernels()`, called before that
    build is done, waits for it (a file lock) instead of compiling the library a second time."""
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "generic")
    monkeypatch.setenv("PAGEDLLM_KERNEL_CFLAGS", "-O0")
    cc, log = _recording_cc(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    cpu_kernels.build_in_background()
    deadline = time.time() + 30
    while not log.exists() or "-o" not in log.read_text():  # the background gcc has started
        assert time.time() < deadline
        time.sleep(0.01)
    lib = cpu_kernels.kernels()
    assert lib is not None and lib.pl_isa == "generic"
    compiles = [line for line in log.read_text().splitlines() if "--version" not in line]
    links = [line for line in compiles if " -c " not in line]
    assert len(links) == 1 and len(list(fresh.glob("*.so"))) == 1
    assert log.read_text().splitlines().count("--version") == 1  # one build plan for both
    cpu_kernels.build_in_background()  # loaded already: nothing to do
    assert [line for line in log.read_text().splitlines() if "--version" not in line] == compiles


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="no C compiler")
def test_built_once_then_loaded_from_the_cache(fresh, monkeypatch):
    """At AVX-512, also where this CPU cannot run that build: it is built with explicit flags,
    and only loaded (never called) here. The builds after it, which test the cache's keys and
    pruning, are of the portable C level (seconds each, where an AVX-512 one takes ~8 s)."""
    monkeypatch.setattr(cpu_isa, "selected", lambda: "avx512")
    monkeypatch.setenv("PAGEDLLM_KERNEL_CFLAGS", "-O0")  # after -O3: the cache is tested, not the code
    assert _reload(monkeypatch) is not None
    (built,) = fresh.glob("*.so")
    assert built.name.startswith("cpu_kernels-avx512-")
    assert stat.S_IMODE(built.stat().st_mode) == 0o777 & ~current_umask()  # as the linker would make it
    inode, stamp = built.stat().st_ino, built.stat().st_mtime_ns
    os.utime(built, ns=(stamp - 10**9, stamp - 10**9))
    assert _reload(monkeypatch) is not None  # loaded, not rebuilt (a rebuild is renamed in: a new inode)
    assert list(fresh.glob("*.so")) == [built] and built.stat().st_ino == inode
    assert built.stat().st_mtime_ns > stamp - 10**9  # the load marked it used: no prune takes it
    # other flags are another build; the first stays until it has gone unused for a day
    monkeypatch.setattr(cpu_isa, "selected", lambda: "generic")
    monkeypatch.setenv("PAGEDLLM_KERNEL_CFLAGS", "-O0 -DPAGEDLLM_TEST_FLAG")
    assert _reload(monkeypatch) is not None
    assert len(list(fresh.glob("*.so"))) == 2
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(built, (day_ago, day_ago))
    monkeypatch.setenv("PAGEDLLM_KERNEL_CFLAGS", "-O0 -DPAGEDLLM_TEST_FLAG=2")
    assert _reload(monkeypatch) is not None
    names = {p.name for p in fresh.glob("*.so")}
    assert built.name not in names and len(names) == 2
    # a build removed under a running process is rebuilt on the next load
    for p in fresh.glob("*.so"):
        p.unlink()
    assert _reload(monkeypatch) is not None and len(list(fresh.glob("*.so"))) == 1


def _defined_exports() -> set[str]:
    """The `pl_*` functions the C files define."""
    import re

    return {name for path in cpu_kernels._SOURCE_DIR.glob("*.c")
            for name in re.findall(r"^void (pl_\w+)\(", path.read_text(), flags=re.M)}


def test_every_export_is_declared_in_the_header_and_bound_from_it():
    declared = cpu_kernels.exports()
    assert set(declared) == _defined_exports()
    assert declared["pl_i8_row_sums"] == [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                          ctypes.c_int]
    assert declared["pl_rms_norm"][8] is ctypes.c_float  # eps
    lib = cpu_kernels.kernels()
    if lib is None:
        pytest.skip("no C kernels on this machine")
    for name, argtypes in declared.items():
        assert getattr(lib, name).argtypes == argtypes, name


def test_a_parameter_the_binding_cannot_express_is_a_clear_error():
    with pytest.raises(ValueError, match="pl_x's parameter 'double y'"):
        cpu_kernels.exports("/* a comment: void pl_y(double z); */ void pl_x(int a, double y);")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("source", [
    "void pl_i8_row_sums(const int8_t *w, int64_t n, int32_t *out, int nthreads) {}",  # drifted from the header
    "void pl_undeclared(int nthreads) {}",  # exported, declared nowhere
], ids=["drifted", "undeclared"])
def test_the_build_refuses_an_export_the_header_does_not_declare_as_defined(tmp_path, source):
    import subprocess

    (tmp_path / "probe.c").write_text(f'#include "common.h"\n{source}\n')
    flags = [f for f in cpu_kernels._FLAGS if f not in ("-shared", "-fPIC")]
    cmd = ["gcc", *flags, "-fsyntax-only", "-I", str(cpu_kernels._SOURCE_DIR), str(tmp_path / "probe.c")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode != 0 and ("conflicting types" in done.stderr or "missing-prototypes" in done.stderr), \
        done.stderr
