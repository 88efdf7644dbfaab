"""HF checkpoint -> GGUF the way llama.cpp's convert_hf_to_gguf.py writes one, for tests of the
converter back: tensor names from the gguf package's TensorNameMap, llama.cpp's weight transforms
(llama q/k row interleave, Gemma's 1 + w norms, GPT-2's Conv1D transposes, MoE experts stacked),
its metadata keys, and a byte-level BPE tokenizer with a chat template. As with `--outtype f16`,
matrices are f16 and vectors f32; the tensors named in `q8` are Q8_0."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np

Q8 = gguf.GGMLQuantizationType.Q8_0
GGUF_ARCH = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3",
    "phi3": "phi3", "gpt2": "gpt2", "starcoder2": "starcoder2",
}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's rotate-half q/k rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or {}
    return float(rope.get("full_attention", rope).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _metadata(w: gguf.GGUFWriter, arch: str, cfg: dict) -> None:
    """The keys llama.cpp's TextModel.set_gguf_parameters (and the per-arch overrides) write."""
    if arch == "gpt2":
        w.add_block_count(cfg["n_layer"])
        w.add_context_length(cfg["n_positions"])
        w.add_embedding_length(cfg["n_embd"])
        w.add_feed_forward_length(4 * cfg["n_embd"])
        w.add_head_count(cfg["n_head"])
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    heads = cfg["num_attention_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(_rope_theta(cfg))
    if "rms_norm_eps" in cfg:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "norm_epsilon" in cfg:
        w.add_layer_norm_eps(cfg["norm_epsilon"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "llama":
        w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    if arch == "qwen3moe":
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_rope_freq_base_swa(cfg["rope_parameters"]["sliding_attention"]["rope_theta"])
    if arch == "phi3":
        rope = cfg["rope_parameters"]
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // heads)
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":
            orig = cfg["original_max_position_embeddings"]
            scale = cfg["max_position_embeddings"] / orig
            w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(orig))))
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _tokenizer(w: gguf.GGUFWriter, model_dir: Path, chat_template: str | None) -> None:
    """llama.cpp's _set_vocab_gpt2 for a byte-level BPE tokenizer.json."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"] if t["special"]}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    cfg = json.loads((model_dir / "config.json").read_text())
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id)):
        if cfg.get(f"{key}_token_id") is not None:
            add(cfg[f"{key}_token_id"])
    if cfg["model_type"] == "gemma3_text":  # Gemma files name an <unk>, which GemmaTokenizer requires
        w.add_unk_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def _tensors(arch: str, cfg: dict, state: dict[str, np.ndarray], fuse_gate_up: bool) -> dict[str, np.ndarray]:
    """HF tensors under their GGUF names, transformed as llama.cpp's modify_tensors does."""
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.get("num_hidden_layers") or cfg["n_layer"])
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, data in state.items():
        if m := _EXPERT.match(name):  # stacked per layer and projection: [E, out, in]
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = data
            continue
        if arch == "llama" and ".q_proj." in name:
            data = _permute(data, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            data = _permute(data, cfg["num_key_value_heads"])
        elif arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0
        elif arch == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            data = data.T
        new = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, f"llama.cpp cannot map {name}"
        out[new] = np.ascontiguousarray(data)
    for (bid, proj), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        out[table.get_name(f"model.layers.{bid}.mlp.experts.{proj}_proj") + ".weight"] = stacked
    if fuse_gate_up:  # llama.cpp's --fuse-gate-up-exps: cat([gate, up], dim=1)
        for bid in sorted({bid for bid, _ in experts}):
            gate, up = out.pop(f"blk.{bid}.ffn_gate_exps.weight"), out.pop(f"blk.{bid}.ffn_up_exps.weight")
            out[f"blk.{bid}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
    return out


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes per row] of random blocks of `qtype` whose float16 scales are small and
    finite (weights of order 0.1): what llama-quantize writes, for the types gguf-py cannot
    quantize (the K-quants)."""
    from pagedllm.model_executor.layers.gguf_ops import SCALE_FIELDS

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    reach = {gguf.GGMLQuantizationType.Q6_K: 4064, gguf.GGMLQuantizationType.Q5_K: 1953}.get(qtype, 945)
    for field in SCALE_FIELDS[int(qtype)]:
        scale = rng.uniform(0.5, 1.0, (rows, cols // block)) * 0.1 / reach
        raw[:, :, field : field + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(model_dir: str | Path, path: str | Path, chat_template: str | None = None,
               q8: tuple[str, ...] = ("token_embd.weight",), fuse_gate_up: bool = False,
               types: dict[str, gguf.GGMLQuantizationType] | None = None) -> dict[str, str]:
    """Write `model_dir` (config.json, model.safetensors, tokenizer.json) as the GGUF `path`;
    returns each GGUF tensor's type name. `types`: GGUF tensor name -> type for matrices stored
    otherwise (gguf-py quantizes the legacy types; K-quants get `random_blocks`)."""
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    _metadata(w, arch, cfg)
    _tokenizer(w, model_dir, chat_template)
    types_out: dict[str, str] = {}
    for name, data in _tensors(arch, cfg, load_file(str(model_dir / "model.safetensors")), fuse_gate_up).items():
        data = data.astype(np.float32)
        if types and name in types:
            qtype = types[name]
            try:
                packed = gguf.quantize(data, qtype)
            except NotImplementedError:
                packed = random_blocks(qtype, *data.shape, seed=len(types_out))
            w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
            types_out[name] = qtype.name
            continue
        if name in q8:
            packed = gguf.quantize(data, Q8)
            w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=Q8)
        else:
            w.add_tensor(name, data.astype(np.float16) if data.ndim >= 2 else data)
        types_out[name] = "Q8_0" if name in q8 else ("F16" if data.ndim >= 2 else "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types_out
