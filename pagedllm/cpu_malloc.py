"""glibc's malloc policy for a CPU worker: keep freed memory for the next step while the worker
lives, and hand back what loading freed.

glibc serves each allocation above 32 MiB with a fresh `mmap` and gives it back on free, so a
tensor of that size made every step (the [64, 262144] float32 logits of a batch-64 decode step
are 64 MiB) is paged in again every step: 16k page faults, ~30 ms a step on a 2-vCPU EPYC VM
where a reused buffer is written in ~1.5 ms. While a worker holds it (`keep_freed_memory`, from
`Worker.init_device` to `Worker.shutdown`), the process's main heap serves those allocations
too and is trimmed only past 1 GiB of free memory at its top, so once the heap has settled
(a few steps: torch's aligned allocations do not always fit the block just freed) a step reuses
the last step's pages. The heap keeps its peak while the worker lives, as tcmalloc and jemalloc
(which vLLM-CPU recommends preloading) do. Allocations that large on threads other than the
main one are still mapped by glibc; the engine steps on its process's main thread.
`release_freed_memory` (after loading, and when the last holder lets go) hands free heap
memory back to the OS.

`PAGEDLLM_KEEP_FREED_MEMORY=0` leaves glibc's defaults. Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h) and glibc's defaults for them
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
DEFAULT_TRIM_THRESHOLD = 128 * 1024
DEFAULT_MMAP_MAX = 65536
# Trim the heap's top only past this much free memory: more than any step's temporaries.
KEEP_TRIM_THRESHOLD = 1 << 30

_lock = threading.Lock()
_holders = 0


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


def _set(mmap_max: int, trim_threshold: int) -> bool:
    functions = _mallopt_and_trim()
    if functions is None:
        return False
    mallopt = functions[0]
    return bool(mallopt(M_MMAP_MAX, mmap_max)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))


def keep_freed_memory() -> bool:
    """Hold this process's malloc to reusing freed memory (True if glibc took it). Each call that
    returns True is matched by one `stop_keeping_freed_memory`."""
    global _holders
    if os.environ.get("PAGEDLLM_KEEP_FREED_MEMORY", "1") == "0":
        return False
    with _lock:
        if _holders == 0 and not _set(0, KEEP_TRIM_THRESHOLD):  # glibc still mmaps when the heap cannot grow
            return False
        _holders += 1
        return True


def stop_keeping_freed_memory() -> None:
    """Let go of one hold; the last one restores glibc's defaults and trims the heap."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            _set(DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD)
            release_freed_memory()
