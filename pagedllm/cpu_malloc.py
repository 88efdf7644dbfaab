"""glibc's malloc policy for a CPU worker's process: keep freed memory for the next step, and
hand back what loading freed.

glibc serves each allocation above 32 MiB with a fresh `mmap` and gives it back on free, so a
tensor of that size made every step (the [64, 262144] float32 logits of a batch-64 decode step
are 64 MiB) is paged in again every step: 16k page faults, ~28 ms a step on a 2-vCPU EPYC VM
where a reused buffer is written in ~1.5 ms. `keep_freed_memory` (at the worker's start) turns
`mmap` off for allocations and trims the heap's top only past 1 GiB, so a freed block is reused
by a later allocation of its size. The heap keeps its peak: memory freed after a long prefill
stays with the process for the next one (as with tcmalloc and jemalloc, which vLLM-CPU
recommends preloading). `release_freed_memory` (after loading) still hands the OS the heap that
loading freed (checkpoint tensors, float weights replaced by packed or quantized copies:
hundreds of MB).

`PAGEDLLM_KEEP_FREED_MEMORY=0` leaves glibc's defaults. Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Callable

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# Trim the heap's top only past this much free memory: more than any step's temporaries.
TRIM_THRESHOLD = 1 << 30

_done = False


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


def keep_freed_memory() -> bool:
    """Set this process's malloc to reuse freed memory (once; True if glibc took it)."""
    global _done
    if _done:
        return True
    functions = _mallopt_and_trim()
    if os.environ.get("PAGEDLLM_KEEP_FREED_MEMORY", "1") == "0" or functions is None:
        return False
    mallopt = functions[0]
    # When the heap cannot grow, glibc still falls back to mmap, so large requests never fail for it.
    _done = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        logger.warning("mallopt refused the settings: large tensors are paged in again at each step")
    return _done
