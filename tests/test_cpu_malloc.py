"""glibc set to keep freed memory: a large tensor made again after it was freed is not paged
in again (checked in fresh interpreters, since the setting is for the whole process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")

# The logits of a batch-64 step of a 262144-token vocabulary, 64 MiB of float32, made and freed
# 16 times; prints the page faults of the last four. glibc settles into reusing the freed
# block within a few rounds (its aligned allocations do not always fit the block just freed).
SCRIPT = """
import resource, torch
from pagedllm.cpu_malloc import keep_freed_memory
print(keep_freed_memory())
head = torch.randn(262144, 64)
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    logits = torch.randn(64, 64) @ head.T
    logits.argmax(dim=1).tolist()
    del logits
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[-4:]))
"""


def _run(keep: str) -> tuple[str, int]:
    env = {**os.environ, "PAGEDLLM_KEEP_FREED_MEMORY": keep, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    took, faults = out.stdout.split()
    return took, int(faults)


def test_a_freed_large_tensor_is_reused_without_page_faults():
    took, faults = _run("1")
    assert took == "True"
    assert faults < 2000  # 16,384 pages of 4 KiB a round if it were paged in again


def test_the_environment_leaves_glibc_as_it_is():
    took, faults = _run("0")
    assert took == "False"
    assert faults > 4 * 16000  # what the setting removes: every round paged in afresh
