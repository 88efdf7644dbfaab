"""Medusa drafts: extra heads on the target's last hidden state, head i guessing the token i + 1
places after the one the target samples from that state. No KV cache and no second forward
pass: the heads run on the hidden rows of the step the target just computed.

A head is `num_hidden_layers` residual blocks (h + SiLU(W h + b)) and its own LM head. Two
checkpoint layouts load: vLLM's (`config.json` with `num_heads`, `num_hidden_layers`,
`hidden_size`, `vocab_size`; tensors `blocks.{i}.layers.{j}.weight/bias`, `lm_heads.{i}.weight`)
and FasterDecoding's (`medusa_num_heads`, `medusa_num_layers`; `medusa_lm_head.safetensors` or
`.pt` with `{i}.{j}.linear.weight/bias` and `{i}.{num_layers}.weight`).
"""

from __future__ import annotations

import json
import os
import re

import torch
from torch import nn

from pagedllm.config import MedusaConfig, ModelConfig, SpeculativeConfig
from pagedllm.model_executor.layers.sampler import greedy_argmax
from pagedllm.spec_decode.head_files import load_head_tensors

_FILES = ("model.safetensors", "medusa_lm_head.safetensors", "medusa_lm_head.pt")


def read_medusa_config(path: str) -> MedusaConfig:
    """The heads' shape, from config.json and (FasterDecoding's layout names no sizes) the weights."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"medusa heads at {path!r}: no readable config.json ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"medusa heads at {path!r}: config.json is not a JSON object")
    num_heads = raw.get("num_heads", raw.get("medusa_num_heads"))
    num_layers = raw.get("num_hidden_layers", raw.get("medusa_num_layers"))
    if not isinstance(num_heads, int) or num_heads < 1 or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"medusa heads at {path!r}: config.json needs num_heads / medusa_num_heads (>= 1) and "
                         "num_hidden_layers / medusa_num_layers (>= 0)")
    if raw.get("truncated_vocab_size") not in (None, raw.get("vocab_size")):
        raise ValueError(f"medusa heads at {path!r}: a truncated vocabulary is not supported")
    hidden, vocab = raw.get("hidden_size"), raw.get("vocab_size")
    if hidden is None or vocab is None:
        head = _load_tensors(path).get("lm_heads.0.weight")
        if head is None:
            raise ValueError(f"medusa heads at {path!r}: no hidden_size / vocab_size in config.json and no first "
                             "LM head to read them from")
        vocab, hidden = head.shape
    return MedusaConfig(num_heads, num_layers, int(hidden), int(vocab))


def medusa_config(spec: SpeculativeConfig, path: str, target: ModelConfig) -> MedusaConfig:
    """The heads' config, checked against the target and the number of drafts asked for."""
    config = read_medusa_config(path)
    text = target.text_config
    if (config.hidden_size, config.vocab_size) != (text.hidden_size, text.vocab_size):
        raise ValueError(f"medusa heads at {path!r} take hidden size {config.hidden_size} and vocabulary "
                         f"{config.vocab_size}; the target has {text.hidden_size} and {text.vocab_size}")
    if spec.num_speculative_tokens > config.num_heads:
        raise ValueError(f"speculative_config.num_speculative_tokens ({spec.num_speculative_tokens}) is more than "
                         f"the {config.num_heads} Medusa heads at {path!r} (one draft per head)")
    return config


def _load_tensors(path: str) -> dict[str, torch.Tensor]:
    """The heads' tensors under vLLM's names."""
    tensors = load_head_tensors(path, _FILES, "medusa heads")
    out = {}
    for key, value in tensors.items():
        key = key.removeprefix("medusa_head.")
        m = re.fullmatch(r"(\d+)\.(\d+)\.linear\.(weight|bias)", key)
        if m:  # FasterDecoding: a residual block
            key = f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"
        elif m := re.fullmatch(r"(\d+)\.(\d+)\.weight", key):  # FasterDecoding: the head's own LM head
            key = f"lm_heads.{m[1]}.weight"
        out[key] = value
    return out


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"layers": nn.ModuleList(nn.Linear(h, h) for _ in range(config.num_layers))})
            for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(h, config.vocab_size, bias=False) for _ in range(config.num_heads))

    def forward(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Each of the first `num_heads` heads' logits for the rows: [num_heads, rows, vocab]."""
        out = []
        for block, lm_head in zip(self.blocks[:num_heads], self.lm_heads[:num_heads]):
            x = hidden
            for layer in block["layers"]:
                x = x + nn.functional.silu(layer(x))
            out.append(lm_head(x))
        return torch.stack(out)


def load_medusa(path: str, config: MedusaConfig, dtype: torch.dtype, device: torch.device) -> MedusaHeads:
    heads = MedusaHeads(config)
    tensors = _load_tensors(path)
    missing, unexpected = heads.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"medusa heads at {path!r}: missing {sorted(missing)[:4]}, unexpected "
                         f"{sorted(unexpected)[:4]} tensors")
    return heads.to(dtype=dtype, device=device).eval()


class MedusaProposer:
    """The heads' greedy chain: k drafts per request from the hidden row its last sampled token
    came from (a point-mass draft, so verification samples the target and compares)."""

    def __init__(self, path: str, config: MedusaConfig, k: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = k
        self.heads = load_medusa(path, config, dtype, device)

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, rows: list[int]) -> list[list[int]]:
        """Drafts for the hidden rows `rows` (one per request that sampled)."""
        if not rows:
            return []
        logits = self.heads(hidden[torch.tensor(rows, device=hidden.device)], self.k)
        drafts = greedy_argmax(logits.flatten(0, 1)).view(self.k, len(rows))
        return drafts.t().tolist()
