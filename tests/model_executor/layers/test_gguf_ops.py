"""GGUF kernels (csrc/gguf.c through gguf_ops) against gguf-py: the linear against its
dequantize and a float64 matmul, both of the activations as given (within the int8 rounding:
~1e-2) and of the activations as the kernels quantize them (int8 under a scale per 32 values,
per 256 for the K types, as llama.cpp's Q8_0 / Q8_K: to float32 rounding), the dequantize
equal to it, a row's result independent of its batch, bias, bf16, strided outputs, non-finite
activations. Every kernel test runs once per instruction-set build this CPU runs
(conftest.py's `kernel_isa`); the AVX-512 build (with VNNI and BF16) and the AVX-VNNI one are
compiled even where the CPU cannot run them. Without the kernels (no gcc) the same calls take
the torch fallback and the same checks hold."""

from __future__ import annotations

import platform
import shutil
import subprocess
import warnings

import gguf
import numpy as np
import pytest
import torch

from pagedllm.model_executor.layers import cpu_kernels, gguf_ops

QUANTIZED = [2, 3, 6, 7, 8, 12, 13, 14]  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K
FLOATS = [0, 1, 30]  # F32 F16 BF16
K_TYPES = [12, 13, 14]
N = 48
uses_kernels = pytest.mark.usefixtures("kernel_isa")


def _weight(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid blocks [n, row bytes]: gguf-py's quantization where it has one, else random bytes
    with sane float16 scales."""
    rng = np.random.default_rng(seed)
    if qtype in (2, 3, 6, 7, 8, *FLOATS):
        q = gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32), gguf.GGMLQuantizationType(qtype))
        return np.ascontiguousarray(q).view(np.uint8).reshape(n, -1)
    block, size = gguf_ops.GGUF_TYPES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in gguf_ops.SCALE_FIELDS[qtype]:
        scales = rng.uniform(0.002, 0.02, (n, k // block)).astype(np.float16)
        raw[..., off : off + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def _dequantized(qtype: int, raw: np.ndarray, k: int) -> torch.Tensor:
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.array(deq, dtype=np.float32).reshape(raw.shape[0], k))


def _as_the_kernels_see(x: torch.Tensor, qtype: int) -> torch.Tensor:
    """x after the kernels' int8 quantization of activations (float32 steps as the C code's)."""
    group = 256 if qtype in K_TYPES else 32
    xs = x.float().reshape(x.shape[0], -1, group)
    a = xs.abs().amax(-1, keepdim=True)
    inv = torch.where(a > 0, 127.0 / a, torch.zeros_like(a))
    return ((xs * inv).round().clamp(-127, 127) * (a / 127.0)).reshape(x.shape)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def _kernels_built() -> bool:
    return cpu_kernels.kernels() is not None


@uses_kernels
@pytest.mark.parametrize("k", [256, 512])
@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS)
def test_linear_matches_dequantized_matmul(qtype, k):
    raw = _weight(qtype, N, k)
    w = torch.from_numpy(raw)
    ref_w = _dequantized(qtype, raw, k).double()
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    for m in (1, 5, 64):
        y = gguf_ops.gguf_linear(x[:m], qtype, w, k)
        assert y.shape == (m, N) and y.dtype == torch.float32
        ref = x[:m].double() @ ref_w.T
        assert _rel(y, ref) < (2e-2 if qtype in QUANTIZED else 1e-5), (m, _rel(y, ref))
        if qtype in QUANTIZED and _kernels_built():  # the kernels' own rounding, and nothing else
            seen = _as_the_kernels_see(x[:m], qtype).double() @ ref_w.T
            assert _rel(y, seen) < 1e-5, (m, _rel(y, seen))
    # leading dims pass through
    assert gguf_ops.gguf_linear(x[:6].view(2, 3, k), qtype, w, k).shape == (2, 3, N)


@uses_kernels
@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("long_rows", [False, True])
def test_a_rows_result_does_not_depend_on_its_batch(qtype, long_rows):
    """Same bits for a row alone, in batches of 5 (a weight row at a time), 8 and 11 (panels, a
    short last tile), 64 (every tile position) and 263 (panels met in passes of 256 rows, the
    last a short one). Long rows: more than 8 units (9 super-blocks, 73 blocks), so the per-unit
    lanes wrap."""
    if not _kernels_built():
        pytest.skip("the torch fallback makes no such promise")
    if long_rows:
        k = 2304 if qtype >= 12 else 2336
    else:
        k = 512 if qtype >= 12 else 352  # legacy: 11 blocks, a whole group of 8 and a short one
    raw = _weight(qtype, N + 3, k)  # an odd row count: a partial weight block and panel
    w = torch.from_numpy(raw)
    x = torch.randn(263, k, generator=torch.Generator().manual_seed(2))
    y64 = gguf_ops.gguf_linear(x[:64], qtype, w, k)
    assert _rel(y64, x[:64].double() @ _dequantized(qtype, raw, k).double().T) < 1e-2
    for i in (0, 1, 2, 3, 37, 63):
        assert torch.equal(gguf_ops.gguf_linear(x[i : i + 1], qtype, w, k), y64[i : i + 1]), i
    for start, size in ((0, 5), (2, 5), (59, 5), (0, 8), (50, 11)):
        got = gguf_ops.gguf_linear(x[start : start + size], qtype, w, k)
        assert torch.equal(got, y64[start : start + size]), (start, size)
    y263 = gguf_ops.gguf_linear(x, qtype, w, k)
    assert torch.equal(y263[:64], y64)
    for start, size in ((255, 1), (256, 1), (262, 1), (250, 13), (200, 60)):
        got = gguf_ops.gguf_linear(x[start : start + size], qtype, w, k)
        assert torch.equal(got, y263[start : start + size]), (start, size)


@uses_kernels
@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("m", [5, 11])
def test_bias_bf16_and_a_column_slice_of_the_output(qtype, m):
    """5 rows: a weight row at a time; 11: panels, here 7 of them (the last of 3 columns), so
    the last is run alone where a tile runs them in pairs."""
    k, n = 256, N + 3
    raw = _weight(qtype, n, k)
    w = torch.from_numpy(raw)
    ref_w = _dequantized(qtype, raw, k).double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    y = gguf_ops.gguf_linear(x, qtype, w, k, bias)
    assert _rel(y, x.double() @ ref_w.T + bias.double()) < 2e-2

    xb, bb = x.bfloat16(), bias.bfloat16()
    yb = gguf_ops.gguf_linear(xb, qtype, w, k, bb)
    assert yb.dtype == torch.bfloat16
    assert _rel(yb, xb.double() @ ref_w.T + bb.double()) < 2.5e-2

    # a q/k/v-style segment: columns [7, 7 + n) of a wider output, the rest untouched
    wide = torch.full((m, n + 20), 1234.5)
    out = gguf_ops.gguf_linear(x, qtype, w, k, bias, out=wide[:, 7 : 7 + n])
    assert out.data_ptr() == wide[:, 7:].data_ptr()
    assert torch.equal(wide[:, 7 : 7 + n], y) or not _kernels_built() and torch.allclose(wide[:, 7 : 7 + n], y)
    assert (wide[:, :7] == 1234.5).all() and (wide[:, 7 + n :] == 1234.5).all()


@uses_kernels
@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS)
def test_dequantize_equals_gguf_py(qtype):
    k = 512
    raw = _weight(qtype, N, k, seed=4)
    w = torch.from_numpy(raw)
    ref = _dequantized(qtype, raw, k)
    assert torch.equal(gguf_ops.gguf_dequantize(qtype, w, k), ref)
    rows = [5, 0, 47, 5, 12]
    assert torch.equal(gguf_ops.gguf_dequantize(qtype, w, k, rows), ref[rows])
    assert torch.equal(gguf_ops.gguf_dequantize(qtype, w, k, torch.tensor(rows), torch.bfloat16), ref[rows].bfloat16())
    assert gguf_ops.gguf_dequantize(qtype, w, k, []).shape == (0, k)
    with pytest.raises(IndexError):
        gguf_ops.gguf_dequantize(qtype, w, k, [N])


@uses_kernels
@pytest.mark.parametrize("qtype", [6, 8, 12, 14])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rescore_gives_candidates_their_dequantized_rows_products(qtype, dtype):
    """An LM head's candidates re-scored from its blocks: each named logit becomes hidden . its
    row as gguf_dequantize gives it in hidden's dtype, the others stay, and a row's values do
    not depend on the other rows of the call."""
    k = 512
    w = torch.from_numpy(_weight(qtype, N, k, seed=6))
    hidden = torch.randn(3, k, generator=torch.Generator().manual_seed(qtype)).to(dtype)
    idx = torch.tensor([[5, 0, 47, 12], [1, 2, 3, 4], [47, 46, 45, 5]])
    logits = torch.full((3, N), 7.0, dtype=dtype)
    if not gguf_ops.gguf_rescore(qtype, w, k, logits, idx, hidden):
        assert not _kernels_built()
        return
    want = hidden.double() @ gguf_ops.gguf_dequantize(qtype, w, k, dtype=dtype).double().T
    chosen = torch.zeros(3, N, dtype=torch.bool).scatter_(1, idx, True)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # the stored logit's rounding
    torch.testing.assert_close(logits.double()[chosen], want[chosen], rtol=tol, atol=tol)
    assert (logits[~chosen] == 7.0).all()
    alone = torch.full((1, N), 7.0, dtype=dtype)
    assert gguf_ops.gguf_rescore(qtype, w, k, alone, idx[2:], hidden[2:])
    assert torch.equal(alone, logits[2:])


@uses_kernels
@pytest.mark.parametrize("qtype", [8, 12, 14])
def test_non_finite_activations_give_nan_rows(qtype):
    k = 256
    w = torch.from_numpy(_weight(qtype, N, k))
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(5))
    x[1, 3], x[4, 200] = float("inf"), float("nan")
    y = gguf_ops.gguf_linear(x, qtype, w, k)
    assert not y[1].isfinite().any() and y[4].isnan().all()  # torch's fallback: inf * w is +-inf
    finite = [0, 2, 3, 5]
    assert y[finite].isfinite().all()
    if _kernels_built():
        assert y[1].isnan().all()
        assert torch.equal(y[finite], torch.cat([gguf_ops.gguf_linear(x[i : i + 1], qtype, w, k) for i in finite]))


@uses_kernels
@pytest.mark.parametrize("qtype", [2, 3, 6, 7, 8])
def test_legacy_rows_that_do_not_fill_a_group_and_a_memory_map(qtype, tmp_path):
    """k = 96: three 32-value blocks, less than the kernel's group of 8 (and nothing after the
    row's end may be read: the map ends there); the weight read from a read-only memory map."""
    k = 96
    raw = _weight(qtype, N, k)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    with warnings.catch_warnings():  # torch warns once that it cannot write there: it does not
        warnings.simplefilter("ignore", UserWarning)
        w = torch.from_numpy(mapped)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    y = gguf_ops.gguf_linear(x, qtype, w, k)
    assert _rel(y, x.double() @ _dequantized(qtype, raw, k).double().T) < 1e-2


@uses_kernels
def test_bound_call_replays(kernel_isa):
    if kernel_isa is None:
        pytest.skip("binding needs the kernels")
    k, qtype = 256, 12
    w = torch.from_numpy(_weight(qtype, N, k))
    x = torch.randn(2, k)
    y = torch.empty(2, N)
    call = gguf_ops.bind_gguf_linear(x, qtype, w, k, None, y, 1)
    x.copy_(torch.randn(2, k))
    call()
    assert torch.equal(y, gguf_ops.gguf_linear(x, qtype, w, k))
    with pytest.raises(ValueError):
        gguf_ops.bind_gguf_linear(x, qtype, w, 512, None, y, 1)


def test_the_torch_fallback(monkeypatch):
    """No kernels: gguf-py's dequantize then F.linear, the same shapes and dtypes."""
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    k, qtype = 256, 12
    raw = _weight(qtype, N, k)
    w = torch.from_numpy(raw)
    x = torch.randn(3, k).bfloat16()
    y = gguf_ops.gguf_linear(x, qtype, w, k)
    assert y.dtype == torch.bfloat16 and _rel(y, x.double() @ _dequantized(qtype, raw, k).double().T) < 1e-2
    assert torch.equal(gguf_ops.gguf_dequantize(qtype, w, k, [3]), _dequantized(qtype, raw, k)[[3]])


def test_bad_shapes_fail_in_python():
    w = torch.from_numpy(_weight(12, 4, 256))
    with pytest.raises(ValueError):
        gguf_ops.gguf_linear(torch.randn(1, 128), 12, w, 128)  # not whole super-blocks
    with pytest.raises(ValueError):
        gguf_ops.gguf_linear(torch.randn(1, 512), 12, w, 512)  # rows too short
    with pytest.raises(ValueError):
        gguf_ops.gguf_linear(torch.randn(1, 256), 10, w, 256)  # Q2_K: not supported


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("gcc") is None,
                    reason="x86 builds need gcc on x86")
@pytest.mark.parametrize("extra", [["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                                    "-mavx512bf16"], ["-mavxvnni"]], ids=["avx512-vnni-bf16", "avx-vnni"])
def test_the_builds_this_cpu_cannot_run_compile(extra, tmp_path):
    src = cpu_kernels._SOURCE_DIR / "gguf.c"
    cmd = ["gcc", "-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-c", "-Werror", "-Wall",
           *cpu_kernels._X86_AVX2, *extra, str(src), "-o", str(tmp_path / "gguf.o")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
