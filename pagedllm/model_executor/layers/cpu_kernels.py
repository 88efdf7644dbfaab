"""pagedllm's own CPU kernels (pagedllm/csrc/): int8/int4 GEMV, paged decode attention,
RMSNorm, q/k norm + rotary, gated activations, and top-k / argmax over the logits, for the
decode steps where torch's ops run far below memory bandwidth or cost more in per-op
overhead than in work (docs/performance.md).

The C files are written once over a small vector vocabulary (csrc/vec.h) and compiled on
first use with the system's gcc (~2 s) for the instruction set level `pagedllm.cpu_isa`
selects, with that level's flags: AVX-512 (with VNNI and BF16 where the CPU has them),
AVX2 + FMA (with AVX-VNNI where the CPU has it), or portable C. The library goes to a cache
directory keyed by the sources, the flags, the compiler, the CPU and the level, and is loaded
with ctypes, which drops the GIL for the call. `PAGEDLLM_CPU_ISA=avx2` on an AVX-512 machine
runs the AVX2 build. Without gcc, or with PAGEDLLM_CPU_KERNELS=0, `kernels()` is None and
every caller keeps its torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from pagedllm import cpu_isa, envs
from pagedllm.cache_files import mark_used, prune_stale, write_atomically
from pagedllm.envs import cache_root

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).resolve().parents[2] / "csrc"
# -ffp-contract=off: no fused multiply-adds the code did not write, so a value computed by two
# paths (a batch-1 fast path and the general one) rounds the same in both.
# -Werror=missing-prototypes: a function the library exports must be declared in kernels.h.
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-Werror=missing-prototypes"]
_HEADER = _SOURCE_DIR / "kernels.h"  # the exports, declared once: the C includes it, ctypes reads it
_C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_X86_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_X86_AVX512 = [*_X86_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_STALE_SECONDS = 24 * 3600
_UNSET = object()
_lib: ctypes.CDLL | None | object = _UNSET
_loaded: dict[str, ctypes.CDLL] = {}


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of one `cpu_isa` level. The optional extensions (VNNI, BF16) come
    from what the CPU reports; a level capped below the CPU's own (PAGEDLLM_CPU_ISA) leaves
    out the extensions that belong to the higher level."""
    flags = cpu_isa.cpu_flags()
    if isa == "avx512":
        extra = [f for name, f in (("avx512_vnni", "-mavx512vnni"), ("avx512_bf16", "-mavx512bf16")) if name in flags]
        return _X86_AVX512 + extra
    if isa == "avx2":
        return _X86_AVX2 + (["-mavxvnni"] if "avx_vnni" in flags and not cpu_isa.capped() else [])
    if isa == "generic":
        return ["-Wno-psabi"]  # GCC vector extensions: SSE2 on x86-64, NEON on aarch64
    raise ValueError(f"no kernels for CPU ISA level {isa!r}")


def describe(isa: str) -> str:
    """The path a level's build runs, in words, for logs and `collect-env`."""
    names = {"-mavx512vnni": "VNNI", "-mavx512bf16": "BF16", "-mavxvnni": "AVX-VNNI"}
    extras = [names[f] for f in isa_flags(isa) if f in names]
    base = {"avx512": "AVX-512", "avx2": "AVX2+FMA", "generic": "portable C"}[isa]
    return base + (f" ({', '.join(extras)})" if extras else "")


def _cache_dir() -> Path:
    return cache_root() / "cpu_kernels"


def _cpu_id() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


@dataclass(frozen=True, slots=True)
class _BuildPlan:
    """One level's compile command and its cache path, read from the environment once."""

    cmd: tuple[str, ...]
    sources: tuple[Path, ...]
    target: Path


_plans: dict[tuple[str, ...], _BuildPlan] = {}


def _build_plan(isa: str) -> _BuildPlan:
    """Made once per process for each environment (`build_in_background` and `kernels()`
    both ask): it runs `cc --version` and hashes the sources."""
    cc = envs.CC
    # e.g. PAGEDLLM_KERNEL_CFLAGS="-g -fsanitize=address" (run with libasan preloaded) to debug
    flags = _FLAGS + isa_flags(isa) + envs.PAGEDLLM_KERNEL_CFLAGS.split()
    cache_dir = _cache_dir()
    memo = (isa, cc, *flags, str(cache_dir))
    if (plan := _plans.get(memo)) is not None:
        return plan
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [p.read_text() for p in sorted(_SOURCE_DIR.glob("*.[ch]"))]
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), version, _cpu_id(), isa]).encode())
    target = cache_dir / f"cpu_kernels-{isa}-{key.hexdigest()[:16]}.so"
    plan = _plans[memo] = _BuildPlan((cc, *flags), tuple(sorted(_SOURCE_DIR.glob("*.c"))), target)
    return plan


def _ensure_built(plan: _BuildPlan) -> Path:
    """`plan.target`, compiled first where it is missing. One build at a time per cache
    directory (a file lock), so the engine's background build, its workers and concurrent
    processes never compile the same library twice."""
    target = plan.target
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:  # read-only is enough for flock, and lets other users of a shared cache take it too
        lock = os.open(target.parent / ".build.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:  # cannot create it here: build unlocked (the rename below stays atomic)
        lock = None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():  # nobody built it while this waited
            start = time.perf_counter()
            _compile(list(plan.cmd), list(plan.sources), target)
            logger.info("C kernels compiled in %.1f s (first start only: cached in %s)", time.perf_counter() - start,
                        target)
    finally:
        if lock is not None:
            os.close(lock)  # releases the lock
    return target


def build_in_background() -> None:
    """Start compiling the selected level's library on a daemon thread: gcc runs on another core
    while a first start converts the model, and `kernels()` then finds the library built. The
    command and cache path are read here, in the caller's environment."""
    if not envs.PAGEDLLM_CPU_KERNELS or _lib is not _UNSET:
        return
    try:
        plan = _build_plan(cpu_isa.selected())
    except (OSError, subprocess.CalledProcessError, ValueError):
        return  # kernels() tries again and says why
    if plan.target.exists():
        return

    def build() -> None:
        try:
            _ensure_built(plan)
        except Exception:  # kernels() tries again and says why
            logger.debug("background kernel build failed", exc_info=True)

    threading.Thread(target=build, name="pagedllm-kernel-build", daemon=True).start()


def exports(header: str | None = None) -> dict[str, list[type]]:
    """Each `void pl_*(...)` that kernels.h (or `header`, its text) declares, with the ctypes
    types of its parameters: any pointer a void pointer, `int64_t`, `int` and `float` as such."""
    text = re.sub(r"/\*.*?\*/", " ", _HEADER.read_text() if header is None else header, flags=re.S)
    found = {}
    for name, params in re.findall(r"\bvoid\s+(pl_\w+)\s*\(([^)]*)\)\s*;", text):
        argtypes = []
        for param in params.split(","):
            words = param.replace("*", " * ").split()
            base = [w for w in words[:-1] if w != "const"]
            if "*" in words:
                argtypes.append(ctypes.c_void_p)
            elif len(base) == 1 and base[0] in _C_TYPES:
                argtypes.append(_C_TYPES[base[0]])
            else:
                raise ValueError(f"kernels.h: {name}'s parameter {param.strip()!r} is not a pointer, int, "
                                 f"int64_t or float")
        found[name] = argtypes
    return found


def _build(isa: str) -> ctypes.CDLL:
    plan = _build_plan(isa)
    for attempt in range(2):
        target = _ensure_built(plan)
        try:
            lib = ctypes.CDLL(str(target))
            with contextlib.suppress(FileNotFoundError):  # pruned after the load: it stays mapped
                mark_used(target)  # in use: another version's build does not prune it
            break
        except OSError:  # removed or replaced under us by another process: build it again
            if attempt:
                raise
            target.unlink(missing_ok=True)
    for name, argtypes in exports().items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    lib.pl_isa = isa
    return lib


def _compile(cmd: list[str], sources: list[Path], target: Path) -> None:
    # Built under a temporary name and renamed: concurrent processes never load half a file.
    write_atomically(target, lambda tmp: _compile_into(cmd, sources, tmp), temp_prefix=".build-", executable=True)
    # Builds of other sources or flags (other versions, debug builds) that nobody has used for a
    # day; an active checkout of another version just rebuilds (~1 s) if its build goes.
    prune_stale(target.parent, "*.so", _STALE_SECONDS, keep=target)


def _compile_into(cmd: list[str], sources: list[Path], out: str) -> None:
    """Each source to an object file, as many at once as there are cores (gguf.c alone takes
    ~5 s of the ~10 s on one), then one link: a first start waits about half as long."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pl-build-") as tmp:
        objects = [os.path.join(tmp, f"{src.stem}.o") for src in sources]
        pending = sorted(zip(sources, objects), key=lambda p: -p[0].stat().st_size)  # the longest first
        running: list[subprocess.Popen] = []
        try:
            while pending or running:
                while pending and len(running) < max(1, os.cpu_count() or 1):
                    src, obj = pending.pop(0)
                    running.append(subprocess.Popen([*cmd, "-c", str(src), "-o", obj], stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT, text=True))
                proc = running.pop(0)
                output, _ = proc.communicate()
                if proc.returncode:
                    raise subprocess.CalledProcessError(proc.returncode, proc.args, output)
        finally:
            for proc in running:
                proc.kill()
                proc.wait()
        subprocess.run([*cmd, "-o", out, *objects, "-lm"], capture_output=True, text=True, check=True)


def load(isa: str) -> ctypes.CDLL:
    """The kernel library built for one level (once per process; raises where it cannot be
    built). Tests load every level the CPU can run; the engine uses `kernels()`."""
    if isa not in _loaded:
        _loaded[isa] = _build(isa)
    return _loaded[isa]


def runnable_isas() -> list[str]:
    """The levels this CPU can run, highest first, as far as `PAGEDLLM_CPU_ISA` allows."""
    top = cpu_isa.LEVELS.index(cpu_isa.selected())
    return list(reversed(cpu_isa.LEVELS[: top + 1]))


def kernels() -> ctypes.CDLL | None:
    """The loaded kernel library for the selected level, built on first call; None where it
    cannot be built or is turned off (PAGEDLLM_CPU_KERNELS=0)."""
    global _lib
    if _lib is _UNSET:
        _lib = None
        isa = cpu_isa.selected()
        if envs.PAGEDLLM_CPU_KERNELS:
            try:
                _lib = _build(isa)
                logger.info("CPU kernels: %s path", describe(isa))
            except (OSError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", "") or str(e)
                logger.info("CPU kernels unavailable, using torch ops: %s", detail.strip().splitlines()[-1:])
    return _lib  # type: ignore[return-value]


def loaded_isa() -> str | None:
    """The level `kernels()` runs ("avx512", "avx2", "generic"), building it on first call;
    None where the engine runs torch ops instead."""
    lib = kernels()
    return None if lib is None else lib.pl_isa


_BF16_FLAG = {torch.bfloat16: 1, torch.float32: 0}


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on these tensors: built, and all of them float32 or
    bfloat16 on CPU. The one check every caller makes before taking its kernel path."""
    return all(t.device.type == "cpu" and t.dtype in _BF16_FLAG for t in tensors) and kernels() is not None


def _is_bf16(t: torch.Tensor) -> int:
    try:
        return _BF16_FLAG[t.dtype]
    except KeyError:
        raise TypeError(f"CPU kernels take float32 or bfloat16, not {t.dtype}") from None


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as contiguous [rows, k], without a call when it already is (this is per-call overhead
    on a ~10 us kernel)."""
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()


def _as(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """t in `dtype`, contiguous (the kernels read it with the activations' element size)."""
    return t if t is None or (t.dtype == dtype and t.is_contiguous()) else t.to(dtype).contiguous()


Call = Callable[[], None]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _bound(kernel: Callable[..., None], args: tuple, now: bool, *keep: torch.Tensor | None) -> Call | None:
    """Each op below has one `bind_*` that lays out its kernel's arguments (`args`, tensors as
    data pointers). The decode plan replays the bound call, which keeps the tensors it points
    into (`keep`) alive; an eager wrapper passes `now` and the kernel runs at once, with no call
    object built."""
    if now:
        kernel(*args)
        return None
    call = partial(kernel, *args)
    call.keep = keep  # type: ignore[attr-defined]
    return call


def bind_w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                      y: torch.Tensor, nthreads: int, now: bool = False) -> Call | None:
    """y [M, N] = x [M, K] @ (qweight [N, K] int8 * scales [N] bf16)^T (+ bias), all contiguous,
    bias and y in x's dtype."""
    n, k = qweight.shape
    flag = _is_bf16(x)
    args = (x.data_ptr(), flag, x.shape[0], k, qweight.data_ptr(), scales.data_ptr(), _ptr(bias), n, y.data_ptr(),
            flag, nthreads)
    return _bound(kernels().pl_w8a16_linear, args, now, x, qweight, scales, bias, y)


def bind_w4a16_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                      bias: torch.Tensor | None, y: torch.Tensor, nthreads: int, now: bool = False) -> Call | None:
    """`bind_w8a16_linear` for an int4 weight in `pack_int4`'s layout."""
    n, k = packed.shape[0], packed.shape[1] * 2
    flag = _is_bf16(x)
    args = (x.data_ptr(), flag, x.shape[0], k, packed.data_ptr(), scales_zeros.data_ptr(), group_size, _ptr(bias),
            n, y.data_ptr(), flag, nthreads)
    return _bound(kernels().pl_w4a16_linear, args, now, x, packed, scales_zeros, bias, y)


def w8a16_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [.., K] @ (qweight [N, K] int8 * scales [N] bf16)^T: activations as int16 per row."""
    n, k = qweight.shape
    x2, y = _gemv_io(x, n, k)
    bind_w8a16_linear(x2, qweight, scales, _as(bias, x.dtype), y, torch.get_num_threads(), now=True)
    return _shaped_like(x, y)


def u8s8_rank(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, w_sum: torch.Tensor) -> torch.Tensor:
    """x [.., K] @ (qweight [N, K] int8 within +-64 * scales [N] bf16)^T with each activation
    row quantized to s8 (carried as u8): the LM head's ranking. `w_sum` [N] int32: each weight
    row's sum."""
    n, k = qweight.shape
    x2, y = _gemv_io(x, n, k)
    kernels().pl_u8s8_rank(x2.data_ptr(), _is_bf16(x2), x2.shape[0], k, qweight.data_ptr(), scales.data_ptr(),
                           w_sum.data_ptr(), n, y.data_ptr(), _is_bf16(y), torch.get_num_threads())
    return _shaped_like(x, y)


def i8_row_sums(qweight: torch.Tensor) -> torch.Tensor:
    """Each row's sum of an int8 [N, K] weight, in int32 (`u8s8_rank`'s `w_sum`)."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"i8_row_sums: an int8 matrix, not {qweight.dtype} of shape {tuple(qweight.shape)}")
    q = qweight.contiguous()  # held until the call returns
    n, k = q.shape
    out = torch.empty(n, dtype=torch.int32)
    kernels().pl_i8_row_sums(q.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def w4a16_linear(
    x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [.., K] @ int4 weight (`pack_int4`'s layout and scales)."""
    x2, y = _gemv_io(x, packed.shape[0], packed.shape[1] * 2)
    bind_w4a16_linear(x2, packed, scales_zeros, group_size, _as(bias, x.dtype), y, torch.get_num_threads(), now=True)
    return _shaped_like(x, y)


def w4a8_rank(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """`w4a16_linear` with the activations quantized to 8 bits, not 16: half the multiply-adds,
    for an LM head's ranking, whose top candidates are recomputed from the exact weight."""
    x2, y = _gemv_io(x, packed.shape[0], packed.shape[1] * 2)
    kernels().pl_w4a8_rank(x2.data_ptr(), _is_bf16(x2), x2.shape[0], x2.shape[1], packed.data_ptr(),
                           scales_zeros.data_ptr(), group_size, packed.shape[0], y.data_ptr(), _is_bf16(y),
                           torch.get_num_threads())
    return _shaped_like(x, y)


def _gemv_io(x: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Either GEMV's operands for x [.., K]: its rows [M, K] and y [M, N] in x's dtype."""
    x2 = _rows(x, k)
    return x2, torch.empty((x2.shape[0], n), dtype=x.dtype)


def _shaped_like(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[1])


def pack_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_int4`'s output ([N, K] values in 0..15; [K/g, N, 2] bf16 scale and zero, for
    w = (q - 8) * scale + zero) in the kernel's layout: [N, K/2] uint8 where, per 128 inputs,
    byte i holds input i in its low nibble and input 64 + i in its high one; and [N, K/g, 2]
    float32 (scale, zero - 8 * scale)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // 128, 2, 64)
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    sz = scales_and_zeros.float().transpose(0, 1)
    return packed, torch.stack([sz[..., 0], sz[..., 1] - 8 * sz[..., 0]], dim=-1).contiguous()


def c_enum(source: str, prefix: str) -> dict[str, int]:
    """The `PREFIX... = N` members of the enums of a csrc file, read from the C itself so that
    Python and the kernels name each value once."""
    text = re.sub(r"/\*.*?\*/", " ", (_SOURCE_DIR / source).read_text(), flags=re.S)
    return {name: int(value) for body in re.findall(r"\benum\s*\{([^}]*)\}", text)
            for name, value in re.findall(rf"\b({prefix}\w*)\s*=\s*(\d+)", body)}


# The KV cache's element kinds (csrc/vec.h): the activations' float type, or bytes with scales
_KV = c_enum("vec.h", "KV_")
KV_F32, KV_BF16, KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2 = (
    _KV["KV_F32"], _KV["KV_BF16"], _KV["KV_INT8"], _KV["KV_FP8_E4M3"], _KV["KV_FP8_E5M2"])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    scale: float,
    scales: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """q [S, Hq, D] (one token per sequence) against caches [blocks, block_size, Hk, D], in q's
    dtype, or (`scales`: k_scales, v_scales [blocks, block_size, Hk, D / 32] and the KV kind) bytes."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
            and (k_cache.dtype == q.dtype if scales is None else k_cache.dtype == torch.uint8)):
        raise ValueError("paged_decode_attention: caches must be contiguous, in q's dtype or bytes with scales")
    q = q.contiguous()
    block_tables = block_tables.to(torch.int64)
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    bind_paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, window, scale, out,
                                torch.get_num_threads(), now=True, scales=scales)
    return out


def bind_paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor, window: int | None, scale: float,
                                out: torch.Tensor, nthreads: int, now: bool = False,
                                scales: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> Call | None:
    """`paged_decode_attention` into `out`; q, the caches and their scales contiguous, block_tables
    and seq_lens int64 with unit inner stride."""
    num_seqs, hq, d = q.shape
    hk, block_size = k_cache.shape[2], k_cache.shape[1]
    k_scales, v_scales, kind = scales if scales is not None else (None, None, _is_bf16(q))
    args = (q.data_ptr(), num_seqs, hq, hk, d, k_cache.data_ptr(), v_cache.data_ptr(), block_size, _is_bf16(q), kind,
            _ptr(k_scales), _ptr(v_scales), block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
            window or 0, scale, out.data_ptr(), nthreads)
    return _bound(kernels().pl_paged_decode_attention, args, now, q, k_cache, v_cache, k_scales, v_scales,
                  block_tables, seq_lens, out)


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor,
                   kv_scales: torch.Tensor, kind: int) -> None:
    """k, v [T, hk, d] into their slots of a byte cache [2, blocks, block_size, hk, d] and its
    scales [2, blocks, block_size, hk, d / 32] (kv_quant.py); d % 32 == 0."""
    bind_kv_cache_write(k, v, slots.to(torch.int64).contiguous(), kv_cache, kv_scales, kind,
                        torch.get_num_threads(), now=True)


def bind_kv_cache_write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor,
                        kv_scales: torch.Tensor, kind: int, nthreads: int, now: bool = False) -> Call | None:
    """`kv_cache_write`; k and v rows of contiguous heads (any row stride), slots int64."""
    n, hk, d = k.shape
    for x in (k, v):
        if x.stride(2) != 1 or x.stride(1) != d or x.dtype != k.dtype:
            raise ValueError("kv_cache_write: k and v need contiguous heads, in one dtype")
    if not (kv_cache.is_contiguous() and kv_scales.is_contiguous() and kv_cache.dtype == torch.uint8):
        raise ValueError("kv_cache_write: a contiguous byte cache and scales")
    args = (k.data_ptr(), v.data_ptr(), _is_bf16(k), n, hk, d, k.stride(0), v.stride(0), slots.data_ptr(),
            kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), kv_scales[0].data_ptr(), kv_scales[1].data_ptr(), kind,
            nthreads)
    return _bound(kernels().pl_kv_cache_write, args, now, k, v, slots, kv_cache, kv_scales)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim with a float32 `weight` (1 + w for Gemma, w otherwise);
    with `residual`, returns residual + the norm."""
    shape, cols = x.shape, x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() not in (2, 3):
        x = x.reshape(-1, cols)
    out = torch.empty(x.shape, dtype=x.dtype)
    if residual is not None:
        residual = residual.to(x.dtype).contiguous()
    bind_rms_norm(x, weight, eps, gemma, residual, out, torch.get_num_threads(), now=True)
    return out.view(shape)


def bind_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool, residual: torch.Tensor | None,
                  out: torch.Tensor, nthreads: int, now: bool = False) -> Call | None:
    """`rms_norm` into a contiguous `out` of x's shape; x 2-D or 3-D with a unit last stride
    (its other strides are passed), `residual` contiguous (it may be `out`: each vector is read
    before it is written)."""
    cols = x.shape[-1]
    if x.dim() == 3:
        inner, stride_outer, stride_inner = x.shape[1], x.stride(0), x.stride(1)
    else:
        inner, stride_outer, stride_inner = 1, x.stride(0), 0
    args = (x.data_ptr(), out.numel() // cols, cols, inner, stride_outer, stride_inner, _is_bf16(x),
            weight.data_ptr(), eps, gemma, _ptr(residual), out.data_ptr(), nthreads)
    return _bound(kernels().pl_rms_norm, args, now, x, weight, residual, out)


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest values, in no particular order ([rows, k] int64);
    torch.topk sorts a partial selection, 20-40x slower on [64, 262144] logits."""
    x = x.contiguous()
    rows, n = x.shape
    out = torch.empty(rows, k, dtype=torch.int64)
    kernels().pl_topk_indices(x.data_ptr(), _is_bf16(x), rows, n, k, out.data_ptr(), torch.get_num_threads())
    return out


def rescore_logits(logits: torch.Tensor, idx: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """In place: logits[r, idx[r]] = hidden[r] @ weight[idx[r]].T, in float32."""
    hidden, idx = hidden.contiguous(), idx.contiguous()
    rows, dim = hidden.shape
    assert logits.is_contiguous() and weight.is_contiguous() and idx.dtype == torch.int64
    kernels().pl_rescore_logits(
        hidden.data_ptr(), _is_bf16(hidden), rows, dim, weight.data_ptr(), _is_bf16(weight), idx.data_ptr(),
        idx.shape[1], logits.data_ptr(), _is_bf16(logits), logits.shape[1], torch.get_num_threads(),
    )


_ACT = c_enum("pointwise.c", "ACT_")
ACTIVATIONS = {"silu": _ACT["ACT_SILU"], "gelu_tanh": _ACT["ACT_GELU_TANH"]}


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for x = [.., gate | up] (`ACTIVATIONS`), in one pass."""
    d = x.shape[-1] // 2
    x2 = _rows(x, 2 * d)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype)
    bind_act_and_mul(x2, ACTIVATIONS[act], out, torch.get_num_threads(), now=True)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], d)


def bind_act_and_mul(x: torch.Tensor, act_id: int, out: torch.Tensor, nthreads: int, now: bool = False) -> Call | None:
    """`act_and_mul` of a contiguous x [rows, 2 d] into out [rows, d]; `act_id` from `ACTIVATIONS`."""
    args = (x.data_ptr(), _is_bf16(x), x.shape[0], out.shape[1], act_id, out.data_ptr(), nthreads)
    return _bound(kernels().pl_act_and_mul, args, now, x, out)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum's index, as `x.max(dim=-1).indices` ([rows] int64; a NaN wins)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    kernels().pl_argmax_rows(x.data_ptr(), _is_bf16(x), rows, n, x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row r's draw from probs[r] (unnormalised, >= 0) for u[r] uniform in [0, 1): the first index
    whose running sum passes u[r] times the row's sum, summed in double ([rows] int64; -1 where
    the row's sum is not a positive finite number)."""
    probs, u = probs.float().contiguous(), u.double().contiguous()
    rows, n = probs.shape
    out = torch.empty(rows, dtype=torch.int64)
    kernels().pl_sample_from_probs(probs.data_ptr(), rows, n, u.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def top_p_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's top-p nucleus ([rows, n] bool) from its probabilities (float32, summing to 1):
    the tokens whose likelier tokens' mass is under top_p[r], summed in double; with no sort of
    the row (sampling.c)."""
    probs, top_p = probs.float().contiguous(), top_p.double().contiguous()
    rows, n = probs.shape
    keep = torch.empty(rows, n, dtype=torch.bool)
    kernels().pl_top_p_keep(probs.data_ptr(), rows, n, top_p.data_ptr(), keep.data_ptr(), torch.get_num_threads())
    return keep


def qk_norm_rope(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norms: tuple[torch.Tensor, torch.Tensor, float, bool] | None,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] from the fused projection qkv [T, (Hq + 2 Hk) D]:
    per-head RMSNorm (`norms` = q weight, k weight (float32), eps, Gemma style) then neox
    rotary with cos/sin caches [positions, rot] (float32)."""
    tokens = qkv.shape[0]
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype)
    k = torch.empty((tokens, num_kv_heads, head_dim), dtype=qkv.dtype)
    bind_qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, norms, cos_cache, sin_cache, positions, q, k,
                      torch.get_num_threads(), now=True)
    return q, k


def bind_qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                      norms: tuple[torch.Tensor, torch.Tensor, float, bool] | None, cos_cache: torch.Tensor,
                      sin_cache: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      nthreads: int, now: bool = False) -> Call | None:
    """`qk_norm_rope` into contiguous q [T, Hq, D] and k [T, Hk, D]; qkv rows may be strided."""
    q_w, k_w, eps, gemma = norms if norms is not None else (None, None, 0.0, False)
    args = (qkv.data_ptr(), _is_bf16(qkv), qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, head_dim, _ptr(q_w),
            _ptr(k_w), eps, gemma, cos_cache.data_ptr(), sin_cache.data_ptr(), positions.data_ptr(),
            cos_cache.shape[1], q.data_ptr(), k.data_ptr(), nthreads)
    return _bound(kernels().pl_qk_norm_rope, args, now, qkv, q_w, k_w, cos_cache, sin_cache, positions, q, k)
