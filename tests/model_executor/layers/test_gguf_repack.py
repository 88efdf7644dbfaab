"""Q4_K / Q6_K / Q5_0 / Q4_0 weights repacked 8 rows at a time (csrc/gguf_x8.c through gguf_ops.repack): the
linear over them gives the file layout's results bit for bit at every batch size (the x8 kernels
for a few rows, panels built from the repacked units for many), with bias, bf16 and column-slice
outputs, on every instruction-set build this CPU runs (`kernel_isa`; the portable build reads
each group back in the file's layout). `GGUFLinear.repack` swaps its segments and leaves the
file's pages of them; `page_cache.drop_from_resident` only touches read-only file mappings."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch

from pagedllm.model_executor.layers import cpu_kernels, gguf_ops
from pagedllm.model_executor.layers.gguf_linear import GGUFLinear
from pagedllm.transformers_utils import page_cache
from tests.model_executor.layers.test_gguf_ops import _weight

REPACKED = [12, 14, 6, 2]  # Q4_K, Q6_K, Q5_0, Q4_0
uses_kernels = pytest.mark.usefixtures("kernel_isa")


def _needs_kernels() -> None:
    if cpu_kernels.kernels() is None:
        pytest.skip("no C kernels: nothing is repacked")


@uses_kernels
# k: 1 super-block; 9 (the per-unit lanes wrap); the legacy types also 20 blocks of 32 (a short last group)
@pytest.mark.parametrize("qtype,k", [(q, k) for q in REPACKED for k in (256, 2304)] + [(6, 640), (2, 640)])
def test_repacked_weights_give_the_file_layouts_bits_at_every_batch(qtype, k):
    _needs_kernels()
    n = 56  # 7 groups of 8: the threads' blocks of 16 rows end on a short one
    w = torch.from_numpy(_weight(qtype, n, k, seed=3))
    packed = gguf_ops.repack(qtype, w, k)
    assert packed.shape == (n, gguf_ops.repacked_row_bytes(qtype, k)) and packed.is_contiguous()
    assert packed.shape[1] == (w.shape[1] if qtype != 14 else k // 256 * 216)  # Q6_K's units padded
    x = torch.randn(263, k, generator=torch.Generator().manual_seed(4))
    for m in (1, 2, 3, 4, 5, 7, 8, 11, 15, 16, 64, 263):  # x8 kernels 4 rows at a time; panels from m = 16
        for dtype in (torch.float32, torch.bfloat16):
            xm = x[:m].to(dtype)
            bias = torch.randn(n, generator=torch.Generator().manual_seed(m)).to(dtype)
            want = gguf_ops.gguf_linear(xm, qtype, w, k, bias)
            got = gguf_ops.gguf_linear(xm, qtype, packed, k, bias, repacked=True)
            assert torch.equal(got, want), (m, dtype)
    wide = torch.zeros(5, n + 7)  # a column slice of a wider output, as a fused projection's part
    gguf_ops.gguf_linear(x[:5], qtype, packed, k, out=wide[:, 3 : 3 + n], repacked=True)
    assert torch.equal(wide[:, 3 : 3 + n], gguf_ops.gguf_linear(x[:5], qtype, w, k))
    assert not wide[:, :3].any() and not wide[:, 3 + n :].any()


@uses_kernels
def test_a_bound_call_runs_the_repacked_layout(kernel_isa):
    _needs_kernels()
    k, n = 512, 16
    w = torch.from_numpy(_weight(12, n, k))
    packed, x, y = gguf_ops.repack(12, w, k), torch.randn(1, k), torch.empty(1, n)
    call = gguf_ops.bind_gguf_linear(x, 12, packed, k, None, y, 2, repacked=True)
    call()
    assert torch.equal(y, gguf_ops.gguf_linear(x, 12, w, k))


def test_q6k_units_are_padded_to_cache_lines_with_zeros():
    _needs_kernels()
    k, n = 512, 8
    w = torch.from_numpy(_weight(14, n, k))
    units = gguf_ops.repack(14, w, k).reshape(-1, 8 * gguf_ops.repacked_row_bytes(14, 256))
    assert units.shape == (2, 1728)
    assert not units[:, 8 * 210 :].any()
    assert int(units[:, : 8 * 210].sum()) == int(w.sum())  # every byte of the blocks, moved


def test_what_cannot_be_repacked():
    _needs_kernels()
    assert not gguf_ops.can_repack(13, torch.zeros(8, 176, dtype=torch.uint8))  # Q5_K
    assert not gguf_ops.can_repack(12, torch.zeros(12, 144, dtype=torch.uint8))  # not whole groups of 8
    with pytest.raises(ValueError, match="not a weight the kernels repack"):
        gguf_ops.repack(12, torch.zeros(12, 144, dtype=torch.uint8), 256)
    w = torch.from_numpy(_weight(12, 8, 256))
    with pytest.raises(ValueError, match="out must be"):
        gguf_ops.repack(12, w, 256, out=torch.empty(8, 100, dtype=torch.uint8))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="runs on the CPU kernels"):
            gguf_ops.gguf_linear(torch.randn(1, 256, device="cuda"), 12, gguf_ops.repack(12, w, 256), 256,
                                 repacked=True)


def _read_only(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # torch cannot write a read-only mapping (nothing does)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class _Tensor:
    """What `GGUFLinear.add` reads of a loaded GGUF tensor."""

    def __init__(self, name: str, qtype: int, blocks: torch.Tensor, k: int) -> None:
        self.name, self.qtype, self._blocks, self.quantized = name, qtype, blocks, True
        self.shape = torch.Size((blocks.shape[0], k))

    def block_rows(self) -> torch.Tensor:
        return self._blocks


def test_a_layer_repacks_the_segments_of_the_types_it_has_kernels_for(tmp_path):
    _needs_kernels()
    if not gguf_ops.repack_pays():
        pytest.skip("the portable build keeps the file's layout")
    k = 512
    layer = GGUFLinear(k, 16 + 16 + 8 + 8 + 8, torch.float32)
    raw = {12: _weight(12, 16, k, 1), 14: _weight(14, 16, k, 2), 8: _weight(8, 8, k, 3), 6: _weight(6, 8, k, 4),
           2: _weight(2, 8, k, 5)}
    path = tmp_path / "blocks.bin"  # the file's pages, as a GGUF's memory map holds them
    offsets, at = {}, 0
    with open(path, "wb") as f:
        for qtype, blocks in raw.items():
            offsets[qtype] = at
            f.write(blocks.tobytes())
            at += blocks.nbytes
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for offset, qtype in ((0, 12), (16, 14), (32, 8), (40, 6), (48, 2)):  # Q4_K, Q6_K, Q8_0, Q5_0, Q4_0
        rows = raw[qtype].shape[0]
        view = mm[offsets[qtype] : offsets[qtype] + raw[qtype].nbytes].reshape(rows, -1)
        layer.add(offset, _Tensor(f"t{qtype}", qtype, _read_only(view), k))
    x = torch.randn(3, k)
    want = layer(x)

    def alloc(shape):  # the loader's arena hands out slices of one mapping; plain tensors do here
        return torch.zeros(shape, dtype=torch.uint8)

    assert layer.repack(alloc) == 16 * 2 * 144 + 16 * 2 * 216 + 8 * 16 * 22 + 8 * 16 * 18
    assert [s.repacked for s in layer.segments] == [True, True, False, True, True]
    assert torch.equal(layer(x), want)
    assert layer.repack(alloc) == 0  # once
    with pytest.raises(ValueError, match="embedding"):
        layer.lookup(torch.tensor([0]))


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/maps, MADV_DONTNEED")
def test_dropping_a_file_mappings_pages_keeps_its_bytes(tmp_path):
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r").reshape(-1, 4096)
    t = _read_only(mm[1:])  # starts one page in: whole pages only are advised
    assert int(t.sum()) == int(data[4096:].sum())  # all resident now
    before = page_cache._mapping_usage(mm.ctypes.data)[0]
    dropped = page_cache.drop_from_resident(t)
    assert dropped == t.numel()
    after = page_cache._mapping_usage(mm.ctypes.data)[0]
    assert after <= before - dropped // 1024 + 4  # kB
    assert torch.equal(t, torch.from_numpy(data[4096:].reshape(-1, 4096)))  # read again from the cache
    anon = torch.arange(1 << 20, dtype=torch.int32).view(-1, 1024)  # anonymous memory: left alone
    assert page_cache.drop_from_resident(anon) == 0
    assert int(anon[-1, -1]) == (1 << 20) - 1


def test_a_weight_not_repacked_is_refused_as_one():
    _needs_kernels()
    w = torch.from_numpy(_weight(14, 8, 256))
    with pytest.raises(ValueError, match="not a repacked weight"):  # 210 bytes a row, not 216
        gguf_ops.gguf_linear(torch.randn(1, 256), 14, w, 256, repacked=True)
    with pytest.raises(ValueError, match="not a repacked weight"):
        gguf_ops.bind_gguf_linear(torch.randn(1, 256), 13, torch.zeros(8, 176, dtype=torch.uint8), 256, None,
                                  torch.empty(1, 8), 1, repacked=True)
