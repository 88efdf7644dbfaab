"""Weights read through 2 MiB pages: a weight file's mapping is advised for them, a file whose
page cache holds 4 KiB pages is dropped and read in again once per boot, and copies
made for the head land in huge-page memory with the same values."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import pytest
import torch

from pagedllm.transformers_utils import page_cache

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux page cache and smaps")


@pytest.fixture
def weight_file(tmp_path, monkeypatch):
    """A small file the module treats as a weight file (its size floor lowered), and a cache
    directory of its own for the marker."""
    monkeypatch.setattr(page_cache, "_MIN_FILE_BYTES", 0)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "w.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
    return str(path)


def _record_drops(monkeypatch) -> list[int]:
    dropped: list[int] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            dropped.append(fd)
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return dropped


def test_a_file_in_small_pages_is_dropped_once_per_boot(weight_file, monkeypatch):
    shares = iter([0.0, 0.1, 0.0])  # first start: small, still small after the drop; second start: small
    monkeypatch.setattr(page_cache, "_huge_share", lambda *args: next(shares))
    dropped = _record_drops(monkeypatch)
    page_cache.read_in_huge_pages(np.memmap(weight_file, dtype=np.uint8, mode="r"), weight_file, 4096)
    assert len(dropped) == 1
    marker = page_cache._marker(os.stat(weight_file))
    assert marker.read_text() == page_cache._boot_id() != ""
    # the next start in this boot leaves the file as its page cache holds it
    page_cache.read_in_huge_pages(np.memmap(weight_file, dtype=np.uint8, mode="r"), weight_file, 4096)
    assert len(dropped) == 1


def test_a_drop_that_gives_huge_pages_leaves_no_marker(weight_file, monkeypatch):
    shares = iter([0.0, 1.0])
    monkeypatch.setattr(page_cache, "_huge_share", lambda *args: next(shares))
    dropped = _record_drops(monkeypatch)
    page_cache.read_in_huge_pages(np.memmap(weight_file, dtype=np.uint8, mode="r"), weight_file, 4096)
    assert len(dropped) == 1
    assert not page_cache._marker(os.stat(weight_file)).exists()


@pytest.mark.parametrize("share", [1.0, None])
def test_a_file_in_huge_pages_or_not_resident_is_left_alone(weight_file, monkeypatch, share):
    monkeypatch.setattr(page_cache, "_huge_share", lambda *args: share)
    dropped = _record_drops(monkeypatch)
    page_cache.read_in_huge_pages(np.memmap(weight_file, dtype=np.uint8, mode="r"), weight_file, 4096)
    assert dropped == []


def test_turned_off_it_reads_nothing(weight_file, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGE_WEIGHTS", "0")
    monkeypatch.setattr(page_cache, "_huge_share", lambda *args: pytest.fail("the sample was read"))
    page_cache.read_in_huge_pages(np.memmap(weight_file, dtype=np.uint8, mode="r"), weight_file, 4096)
    assert page_cache.in_huge_pages(t := torch.zeros(8 << 20)) is t


def test_the_sample_is_read_and_measured_from_smaps(weight_file):
    """The real calls: the sample is populated (MADV_POPULATE_READ) and the mapping's Rss read
    back from /proc/self/smaps; the share is a fraction, whatever the filesystem gives."""
    mm = np.memmap(weight_file, dtype=np.uint8, mode="r")
    start, length = page_cache._sample(mm.nbytes, 4096)
    assert start % (2 << 20) == 0 and 0 < length <= page_cache._SAMPLE_BYTES and start + length <= mm.nbytes
    try:
        share = page_cache._huge_share(mm, start, length)
    except OSError:  # a kernel before 5.14 has no MADV_POPULATE_READ: the loader then leaves it as it is
        pytest.skip("no MADV_POPULATE_READ")
    assert share is not None and 0.0 <= share <= 1.0
    rss, pmd = page_cache._mapping_usage(mm.ctypes.data)
    assert rss * 1024 >= length and 0 <= pmd <= rss


def test_a_copy_in_huge_pages_keeps_the_values():
    t = torch.randn(8 << 20).view(2, -1)  # 32 MiB of float32
    out = page_cache.in_huge_pages(t)
    assert out.data_ptr() != t.data_ptr() and out.data_ptr() % (2 << 20) == 0
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)
    small = torch.ones(1024)
    assert page_cache.in_huge_pages(small) is small
    expected = t.clone()
    del t
    assert torch.equal(out, expected)  # its memory outlives the source and the mapping's name


def test_the_mapping_is_advised_for_huge_pages(weight_file, monkeypatch):
    advised = []
    mm = np.memmap(weight_file, dtype=np.uint8, mode="r")
    real = mm._mmap.madvise

    class Spy:
        def madvise(self, option, *args):
            advised.append(option)
            return real(option, *args)

    monkeypatch.setattr(mm, "_mmap", Spy())
    monkeypatch.setattr(page_cache, "_huge_share", lambda *args: 1.0)
    page_cache.read_in_huge_pages(mm, weight_file, 4096)
    assert advised[:1] == [mmap.MADV_HUGEPAGE]


def _vm_flags(address: int) -> list[str]:
    """VmFlags of this process's mapping that holds `address` ("hg": advised MADV_HUGEPAGE)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_gguf_loader_advises_its_mapping(tmp_path, monkeypatch):
    """read_tensor_table (what every start reads the weights through) maps the file for 2 MiB pages."""
    import gguf

    from pagedllm.transformers_utils.gguf_reader import read_tensor_table

    monkeypatch.setattr(page_cache, "_MIN_FILE_BYTES", 0)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", np.ones((2048, 1024), dtype=np.float32))  # 8 MiB
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (info,) = read_tensor_table(str(path))
    assert "hg" in _vm_flags(info.data.ctypes.data)


def test_the_quantized_weight_cache_loads_into_huge_pages(tmp_path):
    from pagedllm.model_executor.loader import quant_cache

    t = torch.arange(8 << 20, dtype=torch.int32).view(4, -1)  # 32 MiB
    quant_cache.save(tmp_path / "q.safetensors", {"w": t, "small": torch.ones(4)}, {})
    tensors, _ = quant_cache.load(tmp_path / "q.safetensors")
    assert torch.equal(tensors["w"], t) and torch.equal(tensors["small"], torch.ones(4))
    assert tensors["w"].data_ptr() % (2 << 20) == 0 and "hg" in _vm_flags(tensors["w"].data_ptr())

