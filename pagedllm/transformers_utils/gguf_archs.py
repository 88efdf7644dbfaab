"""Per-architecture knowledge for turning a GGUF file back into an HF checkpoint: the HF class,
the config fields transformers' GGUF mapping leaves at class defaults, the HF parameter name of
each GGUF tensor, and the weight fix-ups llama.cpp's converter applied (undone here).

Tensor names come from the `gguf` package's own table (`TensorNameMap`, the one llama.cpp's
converter named them with) applied to the HF model's parameter names, as transformers does, so
no architecture needs a hand-written list."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

# GGUF `general.architecture` values converted; llama covers Mistral (same llama.cpp architecture).
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3", "gpt2", "starcoder2")

# HF model_type (as transformers' GGUF config mapping names it) -> config.json `architectures`.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "starcoder2": "Starcoder2ForCausalLM",
}

# Tensors llama.cpp adds that HF recomputes from the config (llama3 rope frequencies; Phi-3's
# longrope factors, which complete_config moves into rope_scaling).
IGNORED_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

# GPT-2's Conv1D layers store [in, out]; llama.cpp transposes them to [out, in].
_GPT2_CONV1D = re.compile(r"\.(attn_qkv|attn_output|ffn_up|ffn_down)\.weight$")
# transformers keeps a MoE layer's experts stacked in memory but saves them one by one.
_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.layers\.(?P<bid>\d+)\..*experts)\.(gate_up_proj|down_proj)$")
EXPERTS = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.weight$")


def complete_config(cfg: dict[str, Any], arch: str, field: Any, tensors: dict[str, Any]) -> None:
    """Fill the config fields llama.cpp wrote but transformers' GGUF mapping drops, in place.
    `field(key)` reads a metadata value (None when absent); `tensors` maps name -> GGUF tensor."""
    from gguf import Keys

    def get(key: Any) -> Any:
        return field(key.format(arch=arch))

    if arch == "gpt2":
        # wpe has n_ctx rows, while GPT2Config sizes it from n_positions (default 1024).
        if "n_ctx" in cfg:
            cfg["n_positions"] = cfg.pop("n_ctx")
        ff = cfg.pop("feed_forward_length", None)
        if ff is not None and ff != 4 * cfg["n_embd"]:
            cfg["n_inner"] = ff
    elif arch == "starcoder2":
        if (theta := get(Keys.Rope.FREQ_BASE)) is not None:
            cfg["rope_theta"] = float(theta)
        cfg["use_bias"] = "blk.0.attn_q.bias" in tensors
    elif arch == "qwen3moe":
        if (moe_ff := get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)) is not None:
            cfg["moe_intermediate_size"] = int(moe_ff)
    elif arch == "phi3":
        _complete_phi3(cfg, get, tensors)
    elif arch == "gemma3":
        # llama.cpp scales queries by 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 62-layer 27B.
        head_dim = get(Keys.Attention.KEY_LENGTH) or cfg["hidden_size"] // cfg["num_attention_heads"]
        big = cfg.get("num_hidden_layers") == 62
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else head_dim
        if (local_theta := get(Keys.Rope.FREQ_BASE_SWA)) is not None:
            cfg["rope_local_base_freq"] = float(local_theta)


def tidy_floats(value: Any) -> Any:
    """GGUF stores floats as float32: 1e-06 comes back as 9.999999974752427e-07. Write the
    shortest decimal with the same float32 value, as the original config.json had."""
    if isinstance(value, float):
        return float(str(np.float32(value)))
    if isinstance(value, list):
        return [tidy_floats(v) for v in value]
    if isinstance(value, dict):
        return {k: tidy_floats(v) for k, v in value.items()}
    return value


def _complete_phi3(cfg: dict[str, Any], get: Any, tensors: dict[str, Any]) -> None:
    from gguf import Keys

    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rope_dim = get(Keys.Rope.DIMENSION_COUNT)
    if rope_dim and rope_dim != head_dim:  # Phi-4-mini rotates part of each head
        cfg["partial_rotary_factor"] = rope_dim / head_dim
    window = get(Keys.Attention.SLIDING_WINDOW)
    cfg["sliding_window"] = int(window) if window else None  # llama.cpp writes 0 for none
    if (orig := get(Keys.Rope.SCALING_ORIG_CTX_LEN)) is not None:
        cfg["original_max_position_embeddings"] = int(orig)
    if "rope_factors_long.weight" in tensors:  # 128k models: longrope, its factors stored as tensors
        cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": np.asarray(tensors["rope_factors_long.weight"].data, np.float32).tolist(),
            "short_factor": np.asarray(tensors["rope_factors_short.weight"].data, np.float32).tolist(),
        }


def hf_names(arch: str, config: Any) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name. Stacked expert tensors map to a name with `{}` for
    the expert index (`...experts.{}.gate_proj.weight`), the layout save_pretrained writes."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # only the parameter names are needed
        model = AutoModelForCausalLM.from_config(config)
    gguf_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    table = gguf.get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    names: dict[str, str] = {}
    for hf in model.state_dict():
        if m := _STACKED_EXPERTS.match(hf):
            blk, prefix = f"blk.{m['bid']}", m["prefix"]
            for w in ("gate", "up", "down", "gate_up"):
                names[f"{blk}.ffn_{w}_exps.weight"] = f"{prefix}.{{}}.{w}_proj.weight"
            continue
        gguf_name = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            names.setdefault(gguf_name, hf)
    return names


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave (it converts HF's rotate-half rope layout to
    GGUF's adjacent-pairs layout by permuting rows within each head)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def row_order(gguf_name: str, arch: str, config: Any, rows: int) -> np.ndarray | None:
    """The file rows, in the order that gives the HF rows, for the fix-ups that only reorder
    rows (llama's q/k interleave): applied to whole rows of quantized blocks. None: as stored."""
    if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        heads = config.num_key_value_heads if ".attn_k." in gguf_name else config.num_attention_heads
        return _unpermute_rows(np.arange(rows), heads)
    return None


def transposed_in_file(gguf_name: str, arch: str) -> bool:
    """Whether the HF weight is the transpose of the file's matrix (GPT-2's Conv1D layers)."""
    return arch == "gpt2" and bool(_GPT2_CONV1D.search(gguf_name))


def fix_up(w: np.ndarray, gguf_name: str, arch: str, config: Any) -> np.ndarray:
    """Reverse what llama.cpp's converter did to this tensor (as transformers does)."""
    if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        heads = config.num_key_value_heads if ".attn_k." in gguf_name else config.num_attention_heads
        return _unpermute_rows(w, heads)
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return w - 1.0  # Gemma's RMSNorm scales by (1 + w); llama.cpp stores 1 + w
    if arch == "gpt2" and w.ndim == 2 and _GPT2_CONV1D.search(gguf_name):
        return w.T
    return w


def split_experts(w: np.ndarray, gguf_name: str, hf_pattern: str) -> dict[str, np.ndarray]:
    """One [E, out, in] stack -> E per-expert weights; a fused gate_up stack is gate rows first."""
    if "_gate_up_exps." in gguf_name:
        half = w.shape[1] // 2
        gate, up = hf_pattern.replace("gate_up_proj", "gate_proj"), hf_pattern.replace("gate_up_proj", "up_proj")
        return {**split_experts(w[:, :half], "", gate), **split_experts(w[:, half:], "", up)}
    return {hf_pattern.format(e): w[e] for e in range(w.shape[0])}
