"""Pre-quantized checkpoints written the way their tools write them, for the tests: GPTQ
(AutoGPTQ's layout, v1 zero points minus one or v2, act-order g_idx), AWQ (GEMM layout, its
nibble order) and compressed-tensors pack-quantized, from a float model by round-to-nearest.
Each writer returns the dequantized float weights the checkpoint stands for: the reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def rtn(w: np.ndarray, bits: int, groups: np.ndarray, sym: bool,
        bf16_scales: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest of w [N, K] with inputs in groups (`groups` [K]): (q [N, K] in
    0 .. 2^bits - 1, float16 scales [N, G] (`bf16_scales`: ones bfloat16 holds too), zero
    points [N, G]); w ~ s * (q - z)."""
    n, k = w.shape
    g = int(groups.max()) + 1
    maxq = (1 << bits) - 1
    scales, zeros = np.zeros((n, g), np.float16), np.zeros((n, g), np.int64)
    for j in range(g):
        cols = w[:, groups == j]
        lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
        if sym:
            hi = np.maximum(-lo, hi)
            lo = -hi
        s = np.maximum((hi - lo) / maxq, 1e-4).astype(np.float16)
        if bf16_scales:
            s = torch.from_numpy(s).to(torch.bfloat16).to(torch.float16).numpy()
        scales[:, j] = s
        zeros[:, j] = (maxq + 1) // 2 if sym else np.clip(np.round(-lo / s.astype(np.float32)), 0, maxq)
    s = scales.astype(np.float32)[:, groups]
    q = np.clip(np.round(w / s) + zeros[:, groups], 0, maxq).astype(np.int64)
    return q, scales, zeros


def dequantize(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, groups: np.ndarray) -> np.ndarray:
    return (scales.astype(np.float32)[:, groups] * (q - zeros[:, groups])).astype(np.float32)


def pack(values: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> np.ndarray:
    """Values (0 .. 2^bits - 1) packed 32 / bits to an int32 along `axis`, the first lowest
    (AWQ: value order[i] of each 8 in nibble i)."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        v = v[..., order]
    words = np.bitwise_or.reduce(v << (np.arange(per, dtype=np.uint32) * bits), axis=-1)
    return np.moveaxis(words, -1, axis).astype(np.uint32).view(np.int32)


def write_quantized(src: Path, dst: Path, method: str, bits: int = 4, group: int = 128, sym: bool = True,
                    desc_act: bool = False, v2: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """`src`'s float checkpoint (safetensors + config) quantized into `dst`; returns the
    dequantized state dict (every tensor of `src`, the linears replaced)."""
    from safetensors.torch import load_file

    state = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(seed)
    out, ref, orders = {}, {}, {}
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS):
            out[name] = ref[name] = tensor
            continue
        w = tensor.float().numpy()
        n, k = w.shape
        size = k if group == -1 else group
        groups = np.arange(k) // size
        if desc_act:  # groups over a shuffled input order, as act-order assigns them: one order
            # per input (it follows the input's Hessian), so q/k/v and gate/up share theirs
            layer, proj = prefix.rsplit(".", 1)
            key = (layer.rsplit(".", 1)[0], SHARED_INPUT.get(proj, proj))
            perm = orders.setdefault(key, rng.permutation(k))
            groups = np.empty(k, np.int64)
            groups[perm] = np.arange(k) // size
        q, scales, zeros = rtn(w, bits, groups, sym, bf16_scales=method == "compressed-tensors")
        ref[name] = torch.from_numpy(dequantize(q, scales, zeros, groups))
        if method == "gptq":
            out[prefix + ".qweight"] = torch.from_numpy(pack(q.T, bits, 0))
            stored = zeros if v2 else (zeros - 1) & ((1 << bits) - 1)
            out[prefix + ".qzeros"] = torch.from_numpy(pack(stored.T, bits, 1))
            out[prefix + ".scales"] = torch.from_numpy(scales.T.copy())
            out[prefix + ".g_idx"] = torch.from_numpy(groups.astype(np.int32))
        elif method == "awq":
            out[prefix + ".qweight"] = torch.from_numpy(pack(q.T, bits, 1, _AWQ_ORDER))
            out[prefix + ".qzeros"] = torch.from_numpy(pack(zeros.T, bits, 1, _AWQ_ORDER))
            out[prefix + ".scales"] = torch.from_numpy(scales.T.copy())
        else:  # compressed-tensors: signed values stored plus 2^(bits-1), scales [N, G]
            out[prefix + ".weight_packed"] = torch.from_numpy(pack(q, bits, 1))
            out[prefix + ".weight_scale"] = torch.from_numpy(scales).to(torch.bfloat16)
            out[prefix + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
    _write_checkpoint(src, dst, out, _config(method, bits, group, sym, desc_act, v2))
    return ref


def _write_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> None:
    """`tensors` as dst's model.safetensors, src's config with `quantization_config`, and src's
    other files (tokenizer) copied."""
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())


def _config(method: str, bits: int, group: int, sym: bool, desc_act: bool, v2: bool) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": bits, "type": "int", "symmetric": True, "group_size": None if group == -1 else group,
                "strategy": "channel" if group == -1 else "group"}}}}


def write_8bit(src: Path, dst: Path, method: str, fmt: str = "", strategy: str = "channel", group: int = 64,
               static: bool = False, scale_dtype: torch.dtype = torch.float32,
               block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """`src` quantized into an 8-bit checkpoint with weights in a plain `weight` tensor: an FP8
    checkpoint (`method` "fp8": e4m3, one scale per tensor) or compressed-tensors `fmt`
    "float-quantized" (e4m3) / "int-quantized" (int8 W8A8), per `strategy` (tensor, channel, or
    group of `group` inputs for int8), or block-wise float8 (`strategy` "block": a scale per
    `block` of outputs x inputs, as `weight_scale_inv` in an FP8 checkpoint). `static`: with
    activation scales (input_scale). Returns the dequantized state dict."""
    from safetensors.torch import load_file

    state = load_file(str(src / "model.safetensors"))
    out, ref = {}, {}
    is_float = method == "fp8" or fmt == "float-quantized"
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS):
            out[name] = ref[name] = tensor
            continue
        w = tensor.float()
        if strategy == "block":
            out.update(_fp8_blocks(prefix, w, block, scale_dtype, method, ref))
            continue
        top = w.abs().amax() if method == "fp8" or strategy == "tensor" else \
            w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else \
            w.abs().view(w.shape[0], -1, group).amax(dim=-1)
        qmax = 448.0 if is_float else 127.0
        scale = (top / qmax).to(scale_dtype).float()
        full = scale.repeat_interleave(group, dim=1) if strategy == "group" and not is_float else scale
        if is_float:
            q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            q = torch.round(w / full).clamp(-128, 127).to(torch.int8)
        ref[name] = q.float() * full
        out[name] = q
        out[prefix + ".weight_scale"] = scale.to(scale_dtype).reshape(() if method == "fp8" else scale.shape)
        if static:
            out[prefix + ".input_scale"] = torch.tensor(0.05 if is_float else 0.01, dtype=torch.float32)
    _write_checkpoint(src, dst, out, config_8bit(method, fmt, strategy, group, static, block))
    return ref


def _fp8_blocks(prefix: str, w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype, method: str,
                ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One weight as e4m3 with a scale per block of outputs x inputs (the last ones partial)."""
    bn, bk = block
    n, k = w.shape
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w
    tiles = padded.view(padded.shape[0] // bn, bn, -1, bk)
    scale = (tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0).to(scale_dtype).float()
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    ref[prefix + ".weight"] = q.float() * full
    suffix = ".weight_scale_inv" if method == "fp8" else ".weight_scale"
    return {prefix + ".weight": q, prefix + suffix: scale.to(scale_dtype)}


def config_8bit(method: str, fmt: str = "", strategy: str = "channel", group: int = 64, static: bool = False,
                block: tuple[int, int] = (128, 128)) -> dict:
    if method == "fp8":
        blocks = {"weight_block_size": list(block)} if strategy == "block" else {}
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                "ignored_layers": ["lm_head"], **blocks}
    kind = "float" if fmt == "float-quantized" else "int"
    acts = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": not static,
            "strategy": "tensor" if static else "token"}
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "weights": {
                "num_bits": 8, "type": kind, "symmetric": True, "dynamic": False, "strategy": strategy,
                "group_size": group if strategy == "group" else None,
                "block_structure": list(block) if strategy == "block" else None}}}}


def write_tiny_llama(dst: Path, vocab_size: int | None, tie_word_embeddings: bool,
                     dtype: torch.dtype = torch.float32) -> None:
    """A 2-layer Llama (hidden 256) with normal(0, 0.1) random matrices, saved in `dtype` at
    `dst` beside the tests' tokenizer (`vocab_size` None: the tokenizer's): the float source
    the writers above quantize."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.utils import build_tokenizer

    tokenizer = build_tokenizer(str(dst))
    config = LlamaConfig(vocab_size=vocab_size or len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    model.to(dtype).save_pretrained(dst)


def write_dequantized(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`src`'s config and tokenizer with `tensors` (a writer's dequantized weights) in float32 as
    its weights: the checkpoint transformers runs as the reference."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
