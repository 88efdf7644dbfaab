"""The fast GGUF metadata reader: the same fields as gguf's own reader, one parse shared with
transformers' helpers during a conversion, and a config view without the per-token arrays."""

from __future__ import annotations

import threading
from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedllm.transformers_utils.gguf_reader import (
    config_view,
    open_gguf_reader,
    read_tensor_table,
    shared_gguf_reader,
)

VOCAB = 3000  # above the config view's cut-off for an array


def _write(path: Path, with_vocab_size: bool, endianess=gguf.GGUFEndian.LITTLE) -> None:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_name("tiny")
    w.add_block_count(2)
    w.add_context_length(128)
    if with_vocab_size:
        w.add_vocab_size(VOCAB)
    w.add_token_list([f"tok{i}" for i in range(VOCAB)])
    w.add_token_scores([float(-i) for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_array("llama.some.list", [1, 2, 3])
    w.add_float32("llama.some.float", 0.5)
    w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_same_fields_and_tensors_as_gguf_reader(tmp_path, endianess):
    path = tmp_path / "m.gguf"
    _write(path, with_vocab_size=False, endianess=endianess)
    stock, fast = gguf.GGUFReader(str(path)), open_gguf_reader(str(path))
    assert list(stock.fields) == list(fast.fields)
    for key, field in stock.fields.items():
        other = fast.fields[key]
        assert (field.offset, field.data, field.types) == (other.offset, other.data, other.types)
        assert len(field.parts) == len(other.parts)
        for a, b in zip(field.parts, other.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        assert field.contents() == other.contents()
    assert [t.name for t in stock.tensors] == [t.name for t in fast.tensors]
    np.testing.assert_array_equal(stock.tensors[0].data, fast.tensors[0].data)


def test_not_a_gguf_file_is_a_value_error(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        open_gguf_reader(str(path))


def test_shared_reader_serves_its_file_and_links_to_it(tmp_path):
    path, other = tmp_path / "m.gguf", tmp_path / "other.gguf"
    _write(path, with_vocab_size=False)
    _write(other, with_vocab_size=True)
    link = tmp_path / "link.gguf"
    link.symlink_to(path)
    reader = open_gguf_reader(str(path))
    stock = gguf.GGUFReader
    with shared_gguf_reader(reader, str(path)):
        assert gguf.GGUFReader(str(link)) is reader and gguf.GGUFReader(path) is reader
        parsed = gguf.GGUFReader(str(other))
        assert parsed is not reader and "llama.vocab_size" in parsed.fields
    assert gguf.GGUFReader is stock


def test_nested_and_concurrent_sharing_restore_gguf_reader(tmp_path):
    paths = [tmp_path / f"m{i}.gguf" for i in range(2)]
    for p in paths:
        _write(p, with_vocab_size=False)
    readers = [open_gguf_reader(str(p)) for p in paths]
    inner = config_view(readers[0], "llama")
    stock = gguf.GGUFReader
    with shared_gguf_reader(readers[0], str(paths[0])):
        with shared_gguf_reader(inner, str(paths[0])):
            assert gguf.GGUFReader(str(paths[0])) is inner
        assert gguf.GGUFReader(str(paths[0])) is readers[0]
    assert gguf.GGUFReader is stock
    # two threads, entered and left in different orders
    entered, release = [threading.Event() for _ in paths], [threading.Event() for _ in paths]
    seen = {}

    def convert(i):
        with shared_gguf_reader(readers[i], str(paths[i])):
            entered[i].set()
            release[i].wait(10)
            seen[i] = gguf.GGUFReader(str(paths[i])) is readers[i]

    threads = [threading.Thread(target=convert, args=(i,)) for i in range(2)]
    for t, e in zip(threads, entered):
        t.start()
        e.wait(10)
    release[0].set()  # the first in leaves first
    threads[0].join(10)
    assert gguf.GGUFReader is not stock  # the other is still sharing
    release[1].set()
    threads[1].join(10)
    assert seen == {0: True, 1: True} and gguf.GGUFReader is stock


@pytest.mark.parametrize("with_vocab_size", [True, False])
def test_config_view_drops_per_token_arrays(tmp_path, with_vocab_size):
    path = tmp_path / "m.gguf"
    _write(path, with_vocab_size)
    reader = open_gguf_reader(str(path))
    view = config_view(reader, "llama")
    dropped = set(reader.fields) - set(view.fields)
    expected = {"tokenizer.ggml.scores", "tokenizer.ggml.token_type"}
    # without a vocab_size, transformers counts the token list: it stays
    assert dropped == (expected | {"tokenizer.ggml.tokens"} if with_vocab_size else expected)
    assert view.fields["llama.some.list"].contents() == [1, 2, 3]
    assert view.tensors is reader.tensors


def test_tensor_table_matches_gguf_reader(tmp_path):
    """`read_tensor_table` steps over the metadata (string arrays included) and lays each tensor
    out as gguf's reader does: typed float arrays, rows of bytes for block types, a non-default
    alignment honoured."""
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.data_alignment = 64
    w.add_custom_alignment(64)
    w.add_token_list([f"tok{i}" for i in range(VOCAB)])
    w.add_token_scores([float(-i) for i in range(VOCAB)])
    w.add_string("general.description", "a string value")
    w.add_array("llama.some.list", [1, 2, 3])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((4, 64)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    stock, table = gguf.GGUFReader(str(path)).tensors, read_tensor_table(str(path))
    assert [t.name for t in table] == [t.name for t in stock] == ["a.weight", "b.weight", "c.weight"]
    for ours, theirs in zip(table, stock):
        assert ours.tensor_type == theirs.tensor_type
        np.testing.assert_array_equal(ours.shape, theirs.shape)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        np.testing.assert_array_equal(np.asarray(ours.data), np.asarray(theirs.data))


def test_tensor_table_refuses_what_it_cannot_read(tmp_path):
    big = tmp_path / "big.gguf"
    _write(big, with_vocab_size=True, endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError, match="little-endian"):
        read_tensor_table(str(big))
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)  # truncated after the counts
    with pytest.raises(ValueError, match="not a readable GGUF"):
        read_tensor_table(str(bad))
