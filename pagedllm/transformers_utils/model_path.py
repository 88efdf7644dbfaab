"""Turn what the user calls a model into an HF-style directory the engine can load."""

from __future__ import annotations

import os

from pagedllm.transformers_utils.default_model import (
    DEFAULT_MODEL,
    DEFAULT_POOLING_MODEL,
    resolve_default_model,
    resolve_default_pooling_model,
)


def resolve_model_path(model: str | None) -> str:
    """Default name or None → the packaged Gemma GGUF; a .gguf file → its cached
    conversion; an HF directory → itself. Anything else is a clear ValueError."""
    from pagedllm.transformers_utils.gguf_loader import convert_gguf

    if model is None or model == DEFAULT_MODEL:
        return convert_gguf(resolve_default_model())
    if model == DEFAULT_POOLING_MODEL:
        return resolve_default_pooling_model()
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return convert_gguf(path)
        raise ValueError(f"model {model!r} is a file but not a .gguf file")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json; it is not a model")
        return path
    raise ValueError(
        f"model {model!r} does not exist: give an HF-style directory, a .gguf file, "
        f"or {DEFAULT_MODEL!r} (the default)"
    )
