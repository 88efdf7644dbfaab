"""gguf_weights: a converted GGUF directory's tensors, read from the memory-mapped GGUF under their
HF names (nothing is written as a float checkpoint). For a tiny llama file (llama.cpp's q/k row
interleave, Q8_0 and Q4_1 blocks, F32 tensors), with and without the native blocks: the names
and shapes are the HF checkpoint's; `load()` is the reference dequantization (`gguf.dequantize`)
with the interleave undone, the HF source within quantization error, the same either way;
`block_rows()` are the file's rows in HF order; `rows()` cuts them. A tensor type the engine
cannot read is named at conversion; a source file deleted after conversion is a clear error."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedllm.transformers_utils.gguf_loader import convert_gguf  # noqa: E402
from pagedllm.transformers_utils.gguf_weights import GGUFTensor  # noqa: E402
from pagedllm.transformers_utils.weight_utils import iterate_safetensors, iterate_weights  # noqa: E402
from tests.model_executor.loader.test_gguf_loader import (  # noqa: E402
    HEADS,
    KV_HEADS,
    _llama_cpp_permute,
    _write_tiny_gguf,
)

QTYPES = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1]
# An upper bound of a block's rounding error, from the values it quantized (a whole tensor's).
ROUNDING = {"Q8_0": lambda w: np.abs(w).max() / 127, "Q4_1": lambda w: (w.max() - w.min()) / 15}
Q_NAME, K_NAME = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
GATE_NAME, EMBED_NAME = "model.layers.0.mlp.gate_proj.weight", "model.embed_tokens.weight"
has_proc_maps = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")


@pytest.fixture(scope="module", params=QTYPES, ids=lambda t: t.name)
def tiny(request, tmp_path_factory) -> SimpleNamespace:
    """A tiny llama GGUF (untied head; k, o, gate, down and the embedding quantized, the rest F32),
    converted; `expected` is what the old float32 conversion held, `source` the weights before
    quantization."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp(f"gguf_weights_{request.param.name}")
    src = root / "tiny-llama.gguf"
    source: dict[str, np.ndarray] = {}
    expected = _write_tiny_gguf(src, "llama", source=source, qtype=request.param)
    out = convert_gguf(str(src), cache_dir=str(root / "cache"))
    file_tensors = {t.name: t for t in gguf.GGUFReader(str(src)).tensors}
    return SimpleNamespace(src=src, out=out, config=AutoConfig.from_pretrained(out), expected=expected,
                           source=source, file_tensors=file_tensors, qtype=request.param)


def _weights(tiny, native: bool) -> dict[str, GGUFTensor]:
    return dict(iterate_weights(tiny.out, config=tiny.config, gguf_native=native))


def _hf_rows_from_file(gguf_name: str, rows: int) -> np.ndarray:
    """For each HF row, the file row that holds it (llama.cpp interleaved llama's q/k rows)."""
    heads = HEADS if ".attn_q." in gguf_name else KV_HEADS if ".attn_k." in gguf_name else 0
    if not heads:
        return np.arange(rows)
    # The file's row i is HF row permuted[i]: HF row j is file row argsort(permuted)[j].
    return np.argsort(_llama_cpp_permute(np.arange(rows), heads))


def _file_bytes(tiny, gguf_name: str) -> np.ndarray:
    data = np.asarray(tiny.file_tensors[gguf_name].data)
    return data.view(np.uint8).reshape(data.shape[0], -1)


def _in_file_mapping(tensor: torch.Tensor, path: Path) -> bool:
    """Whether `tensor`'s memory lies in a mapping of the file `path` (Linux /proc/self/maps)."""
    ptr, real = tensor.data_ptr(), os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return len(fields) == 6 and fields[5].strip() == real
    return False


@pytest.mark.parametrize("native", [False, True])
def test_names_and_shapes_are_the_hf_checkpoints(tiny, native) -> None:
    from transformers import AutoModelForCausalLM

    weights = _weights(tiny, native)
    with torch.device("meta"):
        hf_state = AutoModelForCausalLM.from_config(tiny.config).state_dict()
    assert sorted(weights) == sorted(tiny.expected) == sorted(hf_state)  # an untied head: every parameter
    types = set()
    for name, t in weights.items():
        assert isinstance(t, GGUFTensor), name
        assert tuple(t.shape) == tiny.expected[name].shape == tuple(hf_state[name].shape), name
        assert t.dtype == torch.float32
        assert t.type_name == tiny.file_tensors[t.name].tensor_type.name
        assert t.quantized == (t.type_name == tiny.qtype.name)
        assert t.native == (native and len(t.shape) == 2), name  # every matrix, float ones too
        types.add((t.type_name, len(t.shape)))
    assert types == {(tiny.qtype.name, 2), ("F32", 2), ("F32", 1)}


@pytest.mark.parametrize("native", [False, True])
def test_load_is_the_reference_dequantization(tiny, native) -> None:
    """What the converter wrote as model.safetensors before: gguf.dequantize of the file's
    tensor, llama's q/k rows put back in HF order; the HF source within the blocks' rounding."""
    for name, t in _weights(tiny, native).items():
        raw = tiny.file_tensors[t.name]
        ref = np.asarray(gguf.dequantize(raw.data, raw.tensor_type), np.float32).reshape(tuple(t.shape))
        ref = ref[_hf_rows_from_file(t.name, ref.shape[0])]
        got = t.load()
        assert got.dtype == torch.float32 and got.shape == t.shape, name
        torch.testing.assert_close(got, torch.from_numpy(ref), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(got, torch.from_numpy(tiny.expected[name]), rtol=0, atol=0, msg=name)
        source = torch.from_numpy(tiny.source[name])
        if t.quantized:
            err = (got - source).abs().max().item()
            assert 0 < err <= ROUNDING[t.type_name](tiny.source[name]), (name, err)
        else:
            torch.testing.assert_close(got, source, rtol=0, atol=0, msg=name)


def test_native_and_float_views_agree(tiny) -> None:
    """The same values whether the engine runs the blocks or their float copy (and through
    iterate_safetensors, which gives GGUF directories loaded too)."""
    plain, native = _weights(tiny, False), _weights(tiny, True)
    loaded = dict(iterate_safetensors(tiny.out))
    assert sorted(plain) == sorted(native) == sorted(loaded)
    for name, t in plain.items():
        assert isinstance(loaded[name], torch.Tensor) and not isinstance(loaded[name], GGUFTensor)
        assert torch.equal(t.load(), native[name].load()), name
        assert torch.equal(t.load(), loaded[name]), name


@pytest.mark.parametrize("name", [Q_NAME, K_NAME, GATE_NAME, EMBED_NAME])
def test_block_rows_are_the_files_rows_in_hf_order(tiny, name) -> None:
    """llama's q (F32) and k (blocks) rows reordered whole; rows that need no reordering are a view
    of the file's mapping. Dequantized, they are `load()`."""
    t, plain = _weights(tiny, True)[name], _weights(tiny, False)[name]
    rows = t.block_rows()
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.type_name]]
    assert rows.dtype == torch.uint8 and tuple(rows.shape) == (t.shape[0], t.shape[1] // block * nbytes)
    file_bytes = _file_bytes(tiny, t.name)
    order = _hf_rows_from_file(t.name, t.shape[0])
    assert np.array_equal(rows.numpy(), file_bytes[order])
    if name in (Q_NAME, K_NAME):
        assert not np.array_equal(order, np.arange(len(order)))  # the case where the order matters
    values = gguf.dequantize(rows.numpy(), gguf.GGMLQuantizationType[t.type_name]).reshape(tuple(t.shape))
    assert torch.equal(torch.from_numpy(np.asarray(values, np.float32)), plain.load())
    assert torch.equal(torch.from_numpy(np.asarray(values, np.float32)), t.load())
    if name in (GATE_NAME, EMBED_NAME):  # in file order: a view of the mapping, not a copy
        part = t.block_rows(5, 7)
        assert part.data_ptr() == rows.data_ptr() + 5 * rows.shape[1]
        assert torch.equal(part, rows[5:12])
        if os.path.exists("/proc/self/maps"):
            assert _in_file_mapping(rows, tiny.src)
    with pytest.raises(ValueError, match="not a native GGUF weight"):
        plain.block_rows()
    with pytest.raises(ValueError, match="not a native GGUF weight"):
        _weights(tiny, True)["model.norm.weight"].block_rows()  # a vector: always the float view


@pytest.mark.parametrize("native", [False, True])
def test_rows_cut_the_hf_rows(tiny, native) -> None:
    """`rows(a, b)` (what a tensor-parallel rank or a fused layer's shard takes) is rows [a, a + b)
    of `load()`: a native part stays unread blocks (a part of a part too), a float one is a tensor."""
    weights = _weights(tiny, native)
    for name in (Q_NAME, K_NAME, GATE_NAME, EMBED_NAME, "lm_head.weight"):
        t = weights[name]
        full = t.load()
        n = full.shape[0]
        for start, length in [(0, n), (3, 5), (n // 2, n - n // 2), (n - 1, 1)]:
            part = t.rows(start, length)
            got = part.load() if native else part
            assert torch.equal(got, full[start : start + length]), (name, start, length)
            if not native:
                assert type(part) is torch.Tensor
            else:
                assert isinstance(part, GGUFTensor) and part.native and tuple(part.shape) == (length, full.shape[1])
                assert torch.equal(part.block_rows(), t.block_rows(start, length))
        if native:  # a part of a part: still the file's blocks
            nested = t.rows(4, 20).rows(3, 5)
            assert nested.native and torch.equal(nested.load(), full[7:12]), name
            assert torch.equal(nested.block_rows(), t.block_rows(7, 5))
        assert torch.equal(t.narrow(0, 6, 9), full[6:15]) and torch.equal(t.narrow(1, 16, 32), full[:, 16:48])
        assert torch.equal(t[2:9], full[2:9])
        target = torch.empty(6, full.shape[1])
        t.copy_to(target, 0, 10)
        assert torch.equal(target, full[10:16])
        for start, length in [(-1, 2), (n - 1, 2)]:
            with pytest.raises(IndexError):
                t.rows(start, length)


@has_proc_maps
def test_load_is_private_memory(tiny) -> None:
    """A loaded tensor is the caller's own memory, as iterate_safetensors promises: writing it
    never reaches the read-only mapping of the file."""
    for native in (False, True):
        for name, t in _weights(tiny, native).items():
            assert not _in_file_mapping(t.load(), tiny.src), (native, name)


def test_an_f64_tensor_loads(tmp_path: Path) -> None:
    path = tmp_path / "f64.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_tensor("output_norm.weight", np.linspace(-1, 1, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    assert tensor.tensor_type.name == "F64"
    t = GGUFTensor(tensor.name, tensor, "qwen3", None, native=True)
    assert not t.native
    torch.testing.assert_close(t.load(), torch.linspace(-1, 1, 64), rtol=0, atol=1e-7)


def test_moe_experts_come_as_per_expert_float_tensors(tmp_path: Path) -> None:
    """A stacked [E, out, in] expert tensor (blocks or float) is read dequantized and split into
    the per-expert weights a checkpoint holds, native or not: the fused experts run in float."""
    from safetensors.torch import load_file

    from tests.model_executor.loader.hf_to_gguf import write_gguf
    from tests.model_executor.loader.test_gguf_archs import _save_source

    _save_source(tmp_path / "hf", "qwen3moe")
    types = write_gguf(tmp_path / "hf", tmp_path / "moe.gguf", q8=("blk.0.ffn_down_exps.weight",))
    assert types["blk.0.ffn_down_exps.weight"] == "Q8_0" and types["blk.1.ffn_gate_exps.weight"] == "F16"
    out = convert_gguf(str(tmp_path / "moe.gguf"), cache_dir=str(tmp_path / "cache"))
    want = load_file(str(tmp_path / "hf" / "model.safetensors"))
    expert = re.compile(r"\.mlp\.experts\.\d+\.")
    for native in (False, True):
        got = dict(iterate_weights(out, gguf_native=native))
        assert sorted(got) == sorted(want)
        assert sum(bool(expert.search(n)) for n in got) == 2 * 3 * 4  # layers x projections x experts
        for name, tensor in got.items():
            if not expert.search(name):
                assert isinstance(tensor, GGUFTensor), name
                continue
            assert type(tensor) is torch.Tensor and tensor.dtype == torch.float32, name
            if ".layers.0.mlp.experts." in name and ".down_proj." in name:
                err = (tensor - want[name]).abs().max().item()
                assert 0 < err <= want[name].abs().max().item() / 127, (name, err)
            else:
                torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)


def test_an_unsupported_tensor_type_is_named_at_conversion(tmp_path: Path) -> None:
    """Types the engine cannot read (here Q2_K and Q3_K) fail the conversion, naming each type and
    its tensors, before any file is written."""
    Q2_K, Q3_K = gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.Q3_K
    path = tmp_path / "q2k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 256), np.float32))
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((4, gguf.GGML_QUANT_SIZES[Q2_K][1]), np.uint8), raw_dtype=Q2_K)
    for i in range(5):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((2, gguf.GGML_QUANT_SIZES[Q3_K][1]), np.uint8),
                     raw_dtype=Q3_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors} == {"F32", "Q2_K", "Q3_K"}
    with pytest.raises(ValueError) as info:
        convert_gguf(str(path), cache_dir=str(tmp_path / "cache"))
    message = str(info.value)
    assert str(path) in message and "does not support" in message
    assert re.search(r"Q2_K: blk\.0\.ffn_down\.weight \(1 tensors?\)", message), message
    assert re.search(r"Q3_K: blk\.0\.attn_q\.weight, .* \(5 tensors\)", message), message
    assert "token_embd" not in message  # F32 is fine
    assert not any((tmp_path / "cache" / "gguf").iterdir())


def test_a_deleted_source_is_a_clear_error(tmp_path: Path) -> None:
    """The conversion keeps no weights: once its GGUF is gone, reading them says so."""
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, "qwen3")
    out = convert_gguf(str(src), cache_dir=str(tmp_path / "cache"))
    assert len(list(iterate_weights(out))) > 0
    src.unlink()
    pattern = rf"the GGUF file {re.escape(str(src))} that {re.escape(out)} was read from is gone"
    with pytest.raises(ValueError, match=pattern):
        list(iterate_weights(out))
    with pytest.raises(ValueError, match=pattern):
        list(iterate_safetensors(out))
