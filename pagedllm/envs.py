"""Environment-derived locations shared across layers (vLLM keeps these in `vllm/envs.py`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where pagedllm keeps what it builds once per machine (GGUF conversions, kernel builds,
    quantized weights): $PAGEDLLM_CACHE_DIR, else $XDG_CACHE_HOME/pagedllm, else ~/.cache/pagedllm."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "pagedllm")
    return Path(root).expanduser()
