"""A random-weight pre-quantized checkpoint in a real model's shape (benchmarks/make_shape_model.py's
SHAPES), written as GPTQ, AWQ, compressed-tensors pack-quantized (W4A16) or int-quantized (W8A8,
`w8a8`) or FP8 (e4m3, a scale per tensor) safetensors, for speed and memory figures at real
sizes. Random packed words are valid quants in every layout; scales are small float16 values;
int8 and e4m3 weights are normal draws quantized; the embedding and norms random bfloat16.

    python benchmarks/make_quantized_shape.py llama-3.2-1b /tmp/l1b-gptq --method gptq [--group 128] [--sym]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
from make_shape_model import SHAPES, write_shape_model  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _shapes(c: dict) -> dict[str, tuple[int, int]]:
    h, i = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return dict(zip(LINEARS, [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]))


def _packed(rng, method: str, n: int, k: int, group: int, sym: bool) -> dict[str, torch.Tensor]:
    if method in ("fp8", "w8a8"):
        w = torch.randn(n, k) * 0.02
        if method == "fp8":
            scale = w.abs().amax() / 448
            return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale.float()}
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        return {"weight": torch.round(w / scale).to(torch.int8), "weight_scale": scale.bfloat16()}
    g = 1 if group == -1 else k // group
    words = lambda *shape: torch.from_numpy(rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32))  # noqa: E731
    scales = rng.uniform(0.002, 0.02, (g, n)).astype(np.float16)
    if method == "compressed-tensors":
        return {"weight_packed": words(n, k // 8), "weight_scale": torch.from_numpy(scales.T.copy()).bfloat16(),
                "weight_shape": torch.tensor([n, k])}
    zeros = torch.full((g, n // 8), 0x77777777 if method == "gptq" else 0x88888888, dtype=torch.int64)
    zeros = zeros.to(torch.int32) if sym else words(g, n // 8)
    out = {"qzeros": zeros, "scales": torch.from_numpy(scales)}
    if method == "gptq":
        g_idx = torch.arange(k, dtype=torch.int32) // (k if group == -1 else group)
        out |= {"qweight": words(k // 8, n), "g_idx": g_idx}
    else:
        out["qweight"] = words(k, n // 8)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("path")
    parser.add_argument("--method", choices=("gptq", "awq", "compressed-tensors", "w8a8", "fp8"),
                        default="gptq")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--sym", action="store_true", help="symmetric (GPTQ's default; compressed-tensors always)")
    args = parser.parse_args()
    config = dict(SHAPES[args.shape])
    write_shape_model(args.shape, args.path)
    rng = np.random.default_rng(0)
    h, vocab = config["hidden_size"], config["vocab_size"]
    state = {"model.embed_tokens.weight": torch.randn(vocab, h, dtype=torch.bfloat16) * 0.02,
             "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not config.get("tie_word_embeddings"):
        state["lm_head.weight"] = torch.randn(vocab, h, dtype=torch.bfloat16) * 0.02
    sym = args.sym or args.method == "compressed-tensors"
    for layer in range(config["num_hidden_layers"]):
        base = f"model.layers.{layer}"
        state[f"{base}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        state[f"{base}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if config["model_type"] == "qwen3":
            d = config["head_dim"]
            state[f"{base}.self_attn.q_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
            state[f"{base}.self_attn.k_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        for name, (n, k) in _shapes(config).items():
            for part, tensor in _packed(rng, args.method, n, k, args.group, sym).items():
                state[f"{base}.{name}.{part}"] = tensor
    save_file(state, os.path.join(args.path, "model.safetensors"), metadata={"format": "pt"})
    if args.method == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    elif args.method == "w8a8":
        qc = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                                  "strategy": "token"}}}}
    elif args.method == "compressed-tensors":
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": args.group}}}}
    else:
        qc = {"quant_method": args.method, "bits": 4, "group_size": args.group, "sym": sym, "desc_act": False,
              "zero_point": True, "version": "gemm"}
    config["quantization_config"] = qc
    with open(os.path.join(args.path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(args.path)


if __name__ == "__main__":
    main()
