"""Speculative decoding settings: `SpeculativeConfig` and the parsing of the user's
`speculative_config` (a dict, or its JSON on the command line).

Kept apart from `pagedllm.config` so that module stays about the engine as a whole; the
dependency goes one way: this module imports `ModelConfig` and `build_model_config` (a
draft model is resolved exactly like the target), and `pagedllm.config` imports this one
only lazily, inside `EngineArgs.create_engine_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from pagedllm.config import ModelConfig, build_model_config


@dataclass(slots=True)
class SpeculativeConfig:
    """Draft tokens proposed each step and verified by the target in one forward pass."""

    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram: shortest suffix n-gram to look up
    prompt_lookup_max: int = 0  # ngram: longest
    draft_model_config: ModelConfig | None = None  # draft_model only

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past its scheduled tokens: the draft model writes its own
        K/V for the tokens it proposes, in the request's blocks."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


_SPEC_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}


def parse_speculative_config(
    spec: dict | str | None, target: ModelConfig, device: torch.device, quantization: str | None = None
) -> SpeculativeConfig | None:
    """From the user's dict (or its JSON, as on the command line) to a checked config.
    `quantization` is what the user asked for (None: each model's own default), which a draft
    model gets too."""
    if spec is None or spec == {}:
        return None
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError("speculative_config must be a dict (or its JSON)")
    unknown = set(spec) - _SPEC_KEYS
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; known: {sorted(_SPEC_KEYS)}")
    method = spec.get("method") or ("draft_model" if spec.get("model") else None)
    if method in ("[ngram]", "ngram") or spec.get("model") == "[ngram]":
        method = "ngram"
    if method not in ("ngram", "draft_model"):
        raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model', got {method!r}")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
    config = SpeculativeConfig(method=method, num_speculative_tokens=k)
    if method == "ngram":
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or lo < 1 or hi < lo:
            raise ValueError(
                f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )
        config.prompt_lookup_min, config.prompt_lookup_max = lo, hi
        return config
    if not spec.get("model"):
        raise ValueError("speculative_config: method 'draft_model' needs 'model' (a path to the draft model)")
    draft = build_model_config(spec["model"], None, target.dtype, device, target.max_model_len,
                               target.seed, target.trust_remote_code, quantization)
    if draft.text_config.vocab_size != target.text_config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.text_config.vocab_size}) differs from the target's "
            f"({target.text_config.vocab_size}); speculation needs the same tokenizer"
        )
    config.draft_model_config = draft
    return config
