"""`pagedllm bench throughput --enable-lora`: the same workload spread over LoRA adapters, either
given (`--lora-path`) or random ones of `--lora-rank` made for the model (`--num-loras`; values do
not change the cost), and with `--compare-no-lora` the workload without adapters, same engine, first."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import torch

from pagedllm.lora.peft import TARGET_MODULES, target_shapes
from pagedllm.lora_request import LoRARequest


def add_lora_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-path", nargs="+", default=None, help="PEFT adapter directories to spread requests over")
    parser.add_argument("--num-loras", type=int, default=0,
                        help="random adapters (all of q/k/v/o/gate/up/down_proj) to spread requests over")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the random adapters (default: %(default)s)")
    parser.add_argument("--compare-no-lora", action="store_true",
                        help="also time the workload without adapters in the same engine, right before")


def write_random_adapter(path: str, text_config: Any, rank: int, seed: int, scale: float = 0.01) -> str:
    """A PEFT-format adapter with random weights (standard deviation `scale`; 0: a no-op adapter)
    for every target module of every layer."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(text_config.num_hidden_layers):
        for module, (out, inp) in target_shapes(text_config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * scale
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGET_MODULES),
                   "bias": "none"}, f)
    return path


def lora_requests(args: argparse.Namespace, text_config: Any, num_prompts: int) -> list[LoRARequest] | None:
    """One adapter per prompt, round robin; None without adapters."""
    paths = list(args.lora_path or [])
    if args.num_loras:
        root = tempfile.mkdtemp(prefix="pagedllm-bench-lora-")
        paths += [write_random_adapter(os.path.join(root, f"lora{i}"), text_config, args.lora_rank, i)
                  for i in range(args.num_loras)]
    if not paths:
        return None
    loras = [LoRARequest(f"lora{i}", i + 1, p) for i, p in enumerate(paths)]
    return [loras[i % len(loras)] for i in range(num_prompts)]
