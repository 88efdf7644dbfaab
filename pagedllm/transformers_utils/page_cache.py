"""A memory-mapped weight file read through 2 MiB pages.

A batch-1 decode step streams every weight once, so it runs at the memory's bandwidth, and
that depends on the page size the mapping is read through. On a 2-vCPU EPYC VM (Linux 6.18,
ext4), reading a 2.49 GB GGUF mapping with two threads gave 29.3 GB/s while the file's page
cache held 4 KiB pages and 35.9 GB/s once it held 2 MiB folios, which the kernel then maps
whole (`FilePmdMapped` in smaps). Which one a file gets is settled when its pages enter the
page cache: a mapping advised MADV_HUGEPAGE faults them in as 2 MiB folios, where the
filesystem has large folios; pages that a writer (llama-quantize) or an earlier reader left in
4 KiB stay so until they are evicted.

So the loader advises the mapping and reads a sample of it. Where the sample comes back in
4 KiB pages, the file's clean cached pages are dropped (`POSIX_FADV_DONTNEED`: pages another
process maps stay) and read in again, once: where that gives 2 MiB pages too, later starts find
them cached so; where it does not (a filesystem without large folios, tmpfs, or another process
holding the pages mapped: a running llama-server on the same file), a marker in the cache
records the file for this boot and later starts leave it as it is.
`PAGEDLLM_HUGE_PAGE_WEIGHTS=0` turns all of it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pagedllm import envs

logger = logging.getLogger(__name__)

MADV_POPULATE_READ = 22  # Linux 5.14; not among Python 3.11's mmap constants
_SAMPLE_BYTES = 64 << 20  # what is read to learn the page size: a few dozen 2 MiB folios
_MIN_FILE_BYTES = 64 << 20  # smaller files: their reads are a small part of a step
_HUGE_SHARE = 0.75  # of the sample mapped in 2 MiB pages: the file is taken as held in them


def read_in_huge_pages(mm: np.memmap, path: str, data_start: int) -> None:
    """Best effort, never an error: advise `mm` (a read-only np.memmap of `path`) for 2 MiB
    pages and, where its tensor data (from `data_start`) is cached in 4 KiB pages, read it in
    again in 2 MiB ones."""
    mapping = getattr(mm, "_mmap", None)
    if not huge_pages_on() or mapping is None or mm.nbytes < _MIN_FILE_BYTES:
        return
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
        start, length = _sample(mm.nbytes, data_start)
        share = _huge_share(mm, start, length)
        if share is None or share >= _HUGE_SHARE:
            return
        marker = _marker(os.stat(path))
        if _boot_id() and marker.is_file() and marker.read_text() == _boot_id():
            return  # dropping its pages did not give 2 MiB ones since the machine started
        began = time.perf_counter()
        mapping.madvise(mmap.MADV_DONTNEED)  # this mapping's own references, or the drop skips them
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        again = _huge_share(mm, start, length)
        if again is not None and again >= _HUGE_SHARE:
            logger.info("%s: its page cache held 4 KiB pages; dropped, it is read in 2 MiB pages (%.1f s)",
                        os.path.basename(path), time.perf_counter() - began)
        else:
            logger.info("%s: the page cache does not hold it in 2 MiB pages here; weights are read in 4 KiB ones",
                        os.path.basename(path))
            with contextlib.suppress(OSError):
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(_boot_id())
    except (OSError, ValueError) as exc:  # an old kernel (no MADV_POPULATE_READ), no smaps: as mapped
        logger.debug("huge pages for %s: %s", path, exc)


def _sample(nbytes: int, data_start: int) -> tuple[int, int]:
    """A 2 MiB-aligned range at the end of the tensor data: the last layers' weights, which
    every step reads (a token embedding, which only its looked-up rows are read of, comes
    first in the files llama.cpp writes)."""
    huge = 2 << 20
    start = -(-max(data_start, nbytes - _SAMPLE_BYTES) // huge) * huge
    return start, max(0, (nbytes - start) // huge * huge)


def _huge_share(mm: np.memmap, start: int, length: int) -> float | None:
    """Read [start, start + length) of the mapping in and say which share of what the whole
    mapping has resident is mapped in 2 MiB pages (None: nothing resident)."""
    if length <= 0:
        return None
    mm._mmap.madvise(MADV_POPULATE_READ, start, length)
    rss, pmd = _mapping_usage(mm.ctypes.data)
    return pmd / rss if rss else None


def _mapping_usage(address: int) -> tuple[int, int]:
    """(Rss, FilePmdMapped) in kB of this process's mapping that starts at `address`."""
    found, rss, pmd = False, 0, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                if found:
                    break
                found = int(head.split("-")[0], 16) == address
            elif found and head == "Rss:":
                rss = int(line.split()[1])
            elif found and head == "FilePmdMapped:":
                pmd = int(line.split()[1])
    if not found:
        raise ValueError(f"no mapping at {address:#x} in /proc/self/smaps")
    return rss, pmd


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def _marker(st: os.stat_result) -> Path:
    """One file per weight file (device, inode), holding the boot id of the failed attempt."""
    return envs.PAGEDLLM_CACHE_DIR / "page_cache" / f"no-huge-folios-{st.st_dev:x}-{st.st_ino:x}"


def huge_pages_on() -> bool:
    """Whether weights read every step go in 2 MiB pages (`PAGEDLLM_HUGE_PAGE_WEIGHTS`, Linux)."""
    return envs.PAGEDLLM_HUGE_PAGE_WEIGHTS and sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE")


def anonymous_zeros(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool) -> torch.Tensor:
    """A CPU tensor of zeros in a private anonymous mapping of its own, which the OS fills with
    zero pages lazily (resident memory grows with use, not with the size) and frees with the
    tensor. `huge_pages`: advised MADV_HUGEPAGE and starting on a 2 MiB boundary, for memory
    read whole every step; otherwise advised MADV_NOHUGEPAGE, for memory written a little at a
    time, where a huge page would be zeroed whole at its first write (with compaction on
    demand), a stall of milliseconds in the middle of a step. Best effort where the kernel has
    no huge pages."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    huge = 2 << 20
    extra = huge if huge_pages else 0  # room to start on a 2 MiB boundary
    mapping = mmap.mmap(-1, max(nbytes + extra, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # EINVAL from a kernel built without huge pages
            mapping.madvise(advice)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(mapping)) % huge if huge_pages else 0
    count = nbytes // dtype.itemsize
    return torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset).view(shape)


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in memory of its own advised MADV_HUGEPAGE (a CPU tensor of 16 MiB or more
    on Linux; others come back as they are): a weight read every step streams at the higher
    bandwidth above."""
    if not huge_pages_on() or t.device.type != "cpu" or t.numel() * t.element_size() < (16 << 20):
        return t
    return anonymous_zeros(tuple(t.shape), t.dtype, huge_pages=True).copy_(t)


def drop_from_resident(t: torch.Tensor) -> int:
    """Take the pages under `t`, a view of a read-only file mapping, out of this process's
    resident memory (MADV_DONTNEED over the whole pages inside its bytes): a weight read once
    into a copy of its own (a repacked GGUF tensor) then stops counting twice. Its bytes stay
    readable, served again by the page cache or the file. Anything else (anonymous or writable
    memory, where the advice would drop the data) is left alone. Returns the bytes advised."""
    if sys.platform != "linux" or t.device.type != "cpu" or t.dim() != 2 or not t.numel():
        return 0
    page = mmap.PAGESIZE
    first = t.data_ptr()
    last = first + (t.shape[0] - 1) * t.stride(0) * t.element_size() + t.shape[1] * t.element_size()
    start, end = -(-first // page) * page, last // page * page
    if end <= start or not _read_only_file_mapping(first, last):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(start, end - start, mmap.MADV_DONTNEED) != 0:
        return 0
    return end - start


def _read_only_file_mapping(first: int, last: int) -> bool:
    """Whether [first, last) lies in one mapping of a file that this process cannot write."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= first < hi:
                return last <= hi and "w" not in fields[1] and len(fields) >= 6 and fields[4] != "0"
    return False
