"""glibc's malloc set to keep freed memory, for a CPU worker's process.

glibc serves each allocation above 32 MiB with a fresh `mmap` and gives it back on free, so a
tensor of that size made every step (the [64, 262144] float32 logits of a batch-64 decode step
are 64 MiB) is paged in again every step: 16k page faults, ~28 ms a step on a 2-vCPU EPYC VM
where a reused buffer is written in ~1.5 ms. With `mmap` off for allocations and the heap's
top not trimmed, a freed block is reused by the next step's allocation of its size. The cost is
that the heap keeps its peak: memory freed after a long prefill stays with the process for the
next one (tcmalloc and jemalloc, which vLLM-CPU recommends preloading, keep it too).

`PAGEDLLM_KEEP_FREED_MEMORY=0` leaves glibc's defaults. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# Trim the heap's top only past this much free memory: more than any step's temporaries.
TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Set this process's malloc to reuse freed memory (once; True if glibc took it)."""
    global _done
    if _done:
        return True
    if os.environ.get("PAGEDLLM_KEEP_FREED_MEMORY", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # When the heap cannot grow, glibc still falls back to mmap, so large requests never fail for it.
    _done = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        logger.warning("mallopt refused the settings: large tensors are paged in again at each step")
    return _done
