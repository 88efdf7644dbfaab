"""glibc held to keeping freed memory while a CPU worker lives: a large tensor comes from the
heap, not a mapping of its own, and once the heap has settled a tensor made again after it was
freed is not paged in again; the last hold restores glibc's defaults. Each case runs in a fresh
interpreter, since the setting is the whole process's."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not hasattr(ctypes.CDLL(None), "mallinfo2")
    or any(name in os.environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")),
    reason="a glibc (>= 2.33) malloc setting")

PRELUDE = """
import ctypes, resource, torch
from pagedllm import cpu_malloc

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Mallinfo2

def mapped_alone(rows=64):
    '''Whether a tensor of rows x 1 MiB (64: a batch-64 step's logits over a 262144-token
    vocabulary) gets a mapping of its own.'''
    before = mallinfo2().hblks
    t = torch.empty(rows, 262144)
    return mallinfo2().hblks > before
"""


def _run(body: str, extra_env: dict[str, str] | None = None) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", **(extra_env or {})}
    for name in ("PAGEDLLM_KEEP_FREED_MEMORY", "GLIBC_TUNABLES", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                 "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        if name not in (extra_env or {}):
            env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", PRELUDE + body], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_large_tensors_come_from_the_heap_while_held_and_are_mapped_again_after():
    out = _run("""
print(mapped_alone())
print(cpu_malloc.keep_freed_memory(), cpu_malloc.keep_freed_memory())  # two workers in one process
print(mapped_alone())
cpu_malloc.stop_keeping_freed_memory()
print(mapped_alone())  # one worker still holds it
cpu_malloc.stop_keeping_freed_memory()
print(mapped_alone(), mapped_alone(4))  # released: mapped above 32 MiB, as glibc settles at
""")
    assert out == ["True", "True", "True", "False", "False", "True", "False"]


@pytest.mark.parametrize("env", [{"PAGEDLLM_KEEP_FREED_MEMORY": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}])
def test_switched_off_or_tuned_by_the_user_glibc_is_left_as_it_is(env):
    assert _run("print(cpu_malloc.keep_freed_memory(), mapped_alone())", env) == ["False", "True"]


def test_a_freed_large_tensor_is_reused_without_page_faults():
    """torch's aligned allocations do not always fit the block just freed, so glibc takes a few
    rounds to settle; after that a round pages nothing in."""
    faults = _run("""
cpu_malloc.keep_freed_memory()
head = torch.randn(262144, 64)
faults = []
for _ in range(24):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    logits = torch.randn(64, 64) @ head.T
    logits.argmax(dim=1).tolist()
    del logits
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
""")
    assert sum(int(f) for f in faults[-4:]) < 2000, faults  # 16,384 pages of 4 KiB a round when paged in again
