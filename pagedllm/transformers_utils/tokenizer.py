"""Tokenizer and stop-token ids for a model directory."""

from __future__ import annotations

import json
import os
from typing import Any


def get_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types; the user needs one message
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e


def get_eos_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json (which may list several, e.g. Gemma's
    <end_of_turn>) plus the tokenizer's own."""
    ids: list[int] = []
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        if isinstance(eos, int):
            ids.append(eos)
        elif isinstance(eos, list):
            ids.extend(int(e) for e in eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
