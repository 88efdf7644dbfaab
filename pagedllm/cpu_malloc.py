"""glibc's malloc policy for a CPU worker: keep freed memory for the next step while the worker
holds it, and hand back what loading freed.

glibc serves each allocation above 32 MiB with a fresh `mmap` and gives it back on free, so a
tensor of that size made every step (the [64, 262144] float32 logits of a batch-64 decode step
are 64 MiB) is paged in again every step: 16k page faults, ~30 ms a step on a 2-vCPU EPYC VM
where a reused buffer is written in ~1.5 ms. While a worker holds it (`keep_freed_memory`, from
`Worker.init_device` to `Worker.shutdown`; for `LLM`, whose engine runs in the caller's process,
until `LLMEngine.shutdown` or that process's end), the process's heap serves those allocations
too and is trimmed only past 1 GiB of free memory at its top, so once the heap has settled (a
few steps: torch's aligned allocations do not always fit the block just freed) a step reuses the
last step's pages. The heap keeps its peak meanwhile, as tcmalloc and jemalloc (which vLLM-CPU
recommends preloading) do. glibc still maps allocations that large on threads other than the
main one; the engine-core and worker processes step on their main threads. When the last hold
ends, allocations above 32 MiB (the ceiling of glibc's own adaptive threshold) are mapped again
and the heap is trimmed. `release_freed_memory` (after loading) hands free heap memory back to
the OS.

Nothing is changed where the user has tuned glibc's malloc (`MALLOC_*_` variables or
`GLIBC_TUNABLES`), with `PAGEDLLM_KEEP_FREED_MEMORY=0`, or elsewhere than glibc.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import threading
from collections.abc import Callable

from pagedllm import envs

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
# After a hold: what glibc's adaptive thresholds settle at for large blocks (mmap above 32 MiB,
# trim past twice that); setting any of them turns the adaptation off for good.
DEFAULT_MMAP_MAX = 65536
RELEASED_MMAP_THRESHOLD = 32 << 20
RELEASED_TRIM_THRESHOLD = 64 << 20
_USER_TUNED = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
# Trim the heap's top only past this much free memory: more than any step's temporaries.
KEEP_TRIM_THRESHOLD = 1 << 30

_lock = threading.Lock()
_holders = 0


@functools.cache
def _mallopt_and_trim() -> tuple[Callable[[int, int], int], Callable[[int], int]] | None:
    """glibc's `mallopt` and `malloc_trim`, or None elsewhere."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return mallopt, trim


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the OS (glibc; elsewhere nothing)."""
    functions = _mallopt_and_trim()
    if functions is not None:
        functions[1](0)


class PeriodicRelease:
    """`release_freed_memory` once every `every` bytes of work counted with `add`: a load that
    frees as it goes (while a worker keeps freed memory) then holds at most that much."""

    __slots__ = ("every", "since")

    def __init__(self, every: int) -> None:
        self.every, self.since = every, 0

    def add(self, nbytes: int) -> None:
        self.since += nbytes
        if self.since >= self.every:
            release_freed_memory()
            self.since = 0


def _user_tuned() -> bool:
    return any(envs.is_set(name) for name in _USER_TUNED) or "glibc.malloc" in envs.GLIBC_TUNABLES


def keep_freed_memory() -> bool:
    """Hold this process's malloc to reusing freed memory (True if glibc took it). Each call that
    returns True is matched by one `stop_keeping_freed_memory`."""
    global _holders
    if not envs.PAGEDLLM_KEEP_FREED_MEMORY or _user_tuned():
        return False
    with _lock:
        if _holders == 0:
            functions = _mallopt_and_trim()
            if functions is None:
                return False
            mallopt = functions[0]
            # With mmap off glibc still maps a block when the heap cannot grow: nothing fails for it.
            if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)):
                mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
                logger.warning("mallopt refused the settings: large tensors are paged in again at each step")
                return False
        _holders += 1
        return True


def stop_keeping_freed_memory() -> None:
    """Let go of one hold; the last one maps allocations above 32 MiB again and trims the heap."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            mallopt, trim = _mallopt_and_trim()
            mallopt(M_MMAP_THRESHOLD, RELEASED_MMAP_THRESHOLD)
            mallopt(M_TRIM_THRESHOLD, RELEASED_TRIM_THRESHOLD)
            mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
            trim(0)
