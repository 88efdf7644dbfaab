"""Tests for the GGUF -> HF-style directory converter (config, tokenizer, gguf_source.json; the
weights are read from the GGUF itself by `iterate_weights`)."""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedllm.config import GGUF_CPU_QUANTIZATION, resolve_quantization  # noqa: E402
from pagedllm.transformers_utils.gguf_loader import (  # noqa: E402
    conversion_cached,
    convert_gguf,
    gguf_is_quantized,
)
from pagedllm.transformers_utils.weight_utils import iterate_weights  # noqa: E402
from tests.utils import all_slow  # noqa: E402

H, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 96, 4, 2, 16, 2
Q8 = gguf.GGMLQuantizationType.Q8_0


def _byte_vocab() -> tuple[list[str], list[str]]:
    """A GPT-2 style byte-level vocab: the 256 byte symbols, three merges and two specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens += ["Ġt", "he", "Ġthe", "<|bos|>", "<|eos|>"]
    return tokens, merges


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (HF rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# What a converted directory holds: no weights (they stay in the GGUF).
CONVERTED_FILES = {"config.json", "generation_config.json", "gguf_source.json", "tokenizer.json",
                   "tokenizer_config.json", "done"}


def converted_state_dict(out: str | Path) -> dict[str, torch.Tensor]:
    """A converted directory's weights under their HF names, as `iterate_weights` reads them from
    the GGUF (dequantized, llama.cpp's fix-ups undone)."""
    return {name: t.load() if hasattr(t, "load") else t for name, t in iterate_weights(str(out))}


_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _stack_experts(state: dict[str, torch.Tensor], model_keys) -> None:
    """transformers 5 holds a MoE layer's experts stacked ([E, 2I, H] gate_up_proj, gate rows
    first; [E, H, I] down_proj), while checkpoints (and `iterate_weights`) give them one by one:
    stack them as `from_pretrained`'s conversion does, in place."""
    for key in model_keys:
        m = _STACKED_EXPERTS.match(key)
        if m is None or key in state:
            continue
        prefix, first = m["prefix"], "gate" if m["proj"] == "gate_up_proj" else "down"
        count = 0
        while f"{prefix}.{count}.{first}_proj.weight" in state:
            count += 1
        parts = ("gate", "up") if first == "gate" else ("down",)
        state[key] = torch.stack([torch.cat([state.pop(f"{prefix}.{e}.{p}_proj.weight") for p in parts])
                                  for e in range(count)])


def load_converted(out: str | Path) -> torch.nn.Module:
    """The transformers model of a converted directory: built from its config.json, with the
    weights `iterate_weights` reads from the GGUF; every parameter loaded (a tied LM head through
    the embedding), nothing left over."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = converted_state_dict(out)
    _stack_experts(state, model.state_dict())
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    tied = config.get_text_config().tie_word_embeddings
    assert (head is embed) == tied
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(result.missing_keys) == ({n for n, p in params.items() if p is head} - set(state) if tied else set())
    return model.eval()


def _write_tiny_gguf(path: Path, arch: str, source: dict[str, np.ndarray] | None = None,
                     qtype: gguf.GGMLQuantizationType = Q8) -> dict[str, np.ndarray]:
    """Write a random tiny model; return the HF state dict the converter should produce (the
    quantized tensors, of type `qtype`, as it rounds them). `source`, when given, receives the HF weights
    before quantization."""
    rng = np.random.default_rng(0)
    tokens, merges = _byte_vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_key_length(HEAD_DIM)  # qwen3's head_dim (16) differs from Qwen3Config's default
    w.add_value_length(HEAD_DIM)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(True)

    expected: dict[str, np.ndarray] = {}

    def put(
        gguf_name: str, hf_name: str, shape: tuple[int, ...], quant: bool = False, permute_heads: int = 0
    ) -> None:
        hf = rng.standard_normal(shape).astype(np.float32) * 0.1
        if source is not None:
            source[hf_name] = hf
        stored = _llama_cpp_permute(hf, permute_heads) if permute_heads else hf
        if quant:
            packed = gguf.quantize(stored, qtype)
            w.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=qtype)
            # Blocks live within a row, so row permutation commutes with the round trip.
            hf = gguf.dequantize(gguf.quantize(hf, qtype), qtype)
        else:
            w.add_tensor(gguf_name, stored)
        expected[hf_name] = hf

    llama = arch == "llama"
    put("token_embd.weight", "model.embed_tokens.weight", (vocab, H), quant=True)
    put("output_norm.weight", "model.norm.weight", (H,))
    if llama:  # untied head; qwen3 ties it to the embeddings
        put("output.weight", "lm_head.weight", (vocab, H))
    for i in range(LAYERS):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        put(b + "attn_norm.weight", p + "input_layernorm.weight", (H,))
        put(
            b + "attn_q.weight",
            p + "self_attn.q_proj.weight",
            (HEADS * HEAD_DIM, H),
            permute_heads=HEADS if llama else 0,
        )
        put(
            b + "attn_k.weight",
            p + "self_attn.k_proj.weight",
            (KV_HEADS * HEAD_DIM, H),
            quant=True,
            permute_heads=KV_HEADS if llama else 0,
        )
        put(b + "attn_v.weight", p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, H))
        put(b + "attn_output.weight", p + "self_attn.o_proj.weight", (H, HEADS * HEAD_DIM), quant=True)
        if not llama:
            put(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", (HEAD_DIM,))
            put(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", (HEAD_DIM,))
        put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (H,))
        put(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (INTER, H), quant=True)
        put(b + "ffn_up.weight", p + "mlp.up_proj.weight", (INTER, H))
        put(b + "ffn_down.weight", p + "mlp.down_proj.weight", (H, INTER), quant=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_gguf_roundtrip(tmp_path: Path, arch: str) -> None:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = tmp_path / "src" / f"tiny-{arch}.gguf"
    src.parent.mkdir()
    expected = _write_tiny_gguf(src, arch)
    cache = tmp_path / "cache"

    assert not conversion_cached(str(src), cache_dir=str(cache))
    out = convert_gguf(str(src), cache_dir=str(cache))
    assert conversion_cached(str(src), cache_dir=str(cache))
    assert Path(out).parent == cache / "gguf"
    assert [p.name for p in (cache / "gguf").iterdir()] == [Path(out).name]  # no temp left over
    assert {p.name for p in Path(out).iterdir()} == CONVERTED_FILES  # no weights: they stay in the GGUF

    config = json.loads((Path(out) / "config.json").read_text())
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert config.get("dtype", "float32") == "float32"
    assert config["head_dim"] == HEAD_DIM
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id) == (
        len(expected["model.embed_tokens.weight"]) - 2,
        len(expected["model.embed_tokens.weight"]) - 1,
    )
    source = json.loads((Path(out) / "gguf_source.json").read_text())
    assert "Q8_0" in source.pop("tensor_types")
    assert source == {"source": str(src), "architecture": arch, "add_bos_token": True}
    # A GGUF with quantized tensors runs quantized on CPU unless told otherwise.
    assert gguf_is_quantized(out)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert resolve_quantization(None, out, cpu, bf16) == GGUF_CPU_QUANTIZATION
    assert resolve_quantization(None, out, cpu, torch.float32) is None  # float32 asks for full precision
    assert resolve_quantization(None, out, cpu, "float32") is None
    assert resolve_quantization(None, out, cpu, "auto") == GGUF_CPU_QUANTIZATION  # float32 or bf16 by the CPU
    assert resolve_quantization(None, out, torch.device("cuda"), bf16) is None
    assert resolve_quantization("none", out, cpu, bf16) is None
    assert resolve_quantization("int8", out, cpu, torch.float32) == "int8"
    assert resolve_quantization("gguf", out, cpu, torch.float32) == "gguf"  # the file's own blocks, when asked

    model = load_converted(out)  # every parameter from the GGUF, none left over
    state = model.state_dict()
    assert sorted(converted_state_dict(out)) == sorted(expected)
    for name, want in expected.items():
        torch.testing.assert_close(state[name], torch.from_numpy(want), rtol=0, atol=0, msg=name)
    assert model.config.tie_word_embeddings == (arch == "qwen3")
    if arch == "qwen3":
        assert model.lm_head.weight is model.model.embed_tokens.weight
        torch.testing.assert_close(state["lm_head.weight"], torch.from_numpy(expected["model.embed_tokens.weight"]),
                                   rtol=0, atol=0)

    # The tokenizer matches what transformers builds from the GGUF, and honours add_bos_token.
    # With transformers 5 it loads as the generic class, straight from tokenizer.json: Python
    # never parses that file (the added tokens are listed in tokenizer_config.json).
    parsed = _json_files_parsed_while(lambda: AutoTokenizer.from_pretrained(out))
    tok = parsed.result
    ref = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    assert tok.added_tokens_decoder == ref.added_tokens_decoder
    if hasattr(transformers, "TokenizersBackend"):
        assert type(tok).__name__ == "TokenizersBackend"
        assert "tokenizer.json" not in parsed.names and "tokenizer_config.json" in parsed.names
    for text in ["the theme", " the cat", "héllo <|eos|>"]:
        assert tok(text).input_ids == ref(text).input_ids
    assert tok("the").input_ids[0] == tok.convert_tokens_to_ids("<|bos|>")

    if arch == "llama":  # transformers un-permutes q/k itself: both must compute the same thing
        ref_model = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=torch.float32
        )
        ids = torch.tensor([[3, 70, 200, 5, 9]])
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref_model(ids).logits)

    start = time.perf_counter()
    assert convert_gguf(str(src), cache_dir=str(cache)) == out
    assert time.perf_counter() - start < 1.0

    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched file -> new entry
    newer = convert_gguf(str(src), cache_dir=str(cache))
    assert newer != out
    assert not Path(out).exists() and [p.name for p in (cache / "gguf").iterdir()] == [Path(newer).name]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="the umask is read from /proc")
def test_conversion_modes_follow_the_umask(tmp_path: Path) -> None:
    """mkdtemp makes an owner-only directory; the finished conversion (and each file in it) gets
    what the umask gives a plain mkdir / open, like the other caches (readable to a shared cache's
    users as far as the umask allows, never beyond it)."""
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, "llama")
    old = os.umask(0o027)
    try:
        out = Path(convert_gguf(str(src), cache_dir=str(tmp_path / "cache")))
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes) == CONVERTED_FILES and set(modes.values()) == {0o640}, modes


class _Parsed:
    names: list[str]
    result: object


def _json_files_parsed_while(fn) -> _Parsed:
    """Run `fn`, noting the base names of the files it parses with `json.load`."""
    parsed = _Parsed()
    parsed.names = []
    real_load = json.load

    def load(f, *args, **kwargs):
        parsed.names.append(os.path.basename(getattr(f, "name", "")))
        return real_load(f, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(json, "load", load)
        parsed.result = fn()
    return parsed


def test_rejects_non_gguf_and_unsupported_arch(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        convert_gguf(str(bogus), cache_dir=str(tmp_path / "cache"))

    other = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(other), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'bert'.*qwen3moe, gemma3, phi3, gpt2, starcoder2"):
        convert_gguf(str(other), cache_dir=str(tmp_path / "cache"))
    # Failed conversions leave no partial cache entries behind.
    assert not any((tmp_path / "cache" / "gguf").iterdir())


@pytest.mark.parametrize("part", ["_build_tokenizer", "_build_config"])
def test_a_failed_conversion_is_its_error_and_leaves_nothing(tmp_path: Path, monkeypatch, part) -> None:
    """A failure while the config or the tokenizer is built reaches the caller as it was raised,
    and no partial cache entry (nor temp directory) stays: the next try converts afresh."""
    from pagedllm.transformers_utils import gguf_loader

    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, "qwen3")
    cache = tmp_path / "cache"

    class Broken(Exception):
        pass

    def broken(*args, **kwargs):
        raise Broken("this part cannot be converted")

    with monkeypatch.context() as mp:
        mp.setattr(gguf_loader, part, broken)
        with pytest.raises(Broken, match="this part cannot be converted"):
            convert_gguf(str(src), cache_dir=str(cache))
    assert not any((cache / "gguf").iterdir())
    assert not conversion_cached(str(src), cache_dir=str(cache))
    out = convert_gguf(str(src), cache_dir=str(cache))
    assert {p.name for p in Path(out).iterdir()} == CONVERTED_FILES


@pytest.mark.slow
@all_slow
def test_default_model_matches_transformers_gguf_loading() -> None:
    """Uses the default cache on purpose: repeated runs reuse the conversion (its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.transformers_utils.default_model import resolve_default_model

    path = resolve_default_model()
    out = convert_gguf(path)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("Hello, my name is", return_tensors="pt").input_ids
    assert ids[0, 0].item() == 2  # <bos>
    eos = json.loads((Path(out) / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [1, 106]

    def greedy(model: torch.nn.Module) -> list[int]:
        with torch.no_grad():
            seq = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
        return seq[0, ids.shape[1] :].tolist()

    ours = greedy(load_converted(out))
    theirs = greedy(
        AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    )
    assert ours == theirs, (tok.decode(ours), tok.decode(theirs))
