"""Give a GGUF file a cached Hugging Face-style directory: config.json, generation_config.json,
the tokenizer files and gguf_source.json, which names the file. The weights stay in the GGUF:
`gguf_weights.iterate_gguf_weights` reads them from the memory-mapped file at every start, under
their HF names with llama.cpp's fix-ups undone, so no float copy of the model is ever written.
Building the tokenizer from a 262k vocabulary takes seconds, so the directory is cached, keyed by
the source file's (absolute path, size, mtime).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.cache_files import umask_mode
from pagedllm.envs import cache_root
from pagedllm.transformers_utils.gguf_archs import (
    HF_ARCHITECTURES,
    SUPPORTED_GGUF_ARCHS,
    complete_config,
    tidy_floats,
)
from pagedllm.transformers_utils.gguf_reader import config_view, open_gguf_reader, shared_gguf_reader
from pagedllm.transformers_utils.gguf_weights import FLOAT_TYPES, SOURCE_FILE, check_tensor_types

logger = logging.getLogger(__name__)
__all__ = ["SUPPORTED_GGUF_ARCHS", "conversion_cached", "convert_gguf", "gguf_is_quantized"]

_DONE = "done"


def _cache_root(cache_dir: str | None) -> Path:
    return (Path(cache_dir).expanduser() if cache_dir else cache_root()) / "gguf"


# Bumped when the conversion's output changes, so older cache entries are redone once.
# 2: gguf_source.json lists the GGUF's tensor types; 3: names from gguf's TensorNameMap, config completions;
# 4: tokenizer_config.json names the generic TokenizersBackend; 5: it lists the added tokens;
# 6: no weights (read from the GGUF itself)
_CONVERSION_VERSION = 6


def _cache_key(path: str) -> str:
    st = os.stat(path)  # FileNotFoundError for a missing file, on purpose
    # transformers' major version too: the tokenizer files name a class only 5.x has
    major = importlib.metadata.version("transformers").split(".")[0]
    ident = f"{path}|{st.st_size}|{st.st_mtime_ns}|v{_CONVERSION_VERSION}|transformers{major}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def conversion_cached(gguf_path: str, cache_dir: str | None = None) -> bool:
    """Whether `convert_gguf` would only reuse a finished conversion of this file."""
    src = os.path.abspath(os.fspath(gguf_path))
    return os.path.isfile(src) and (_cache_root(cache_dir) / _cache_key(src) / _DONE).is_file()


def convert_gguf(gguf_path: str, cache_dir: str | None = None) -> str:
    """Return a directory with config.json, generation_config.json, the tokenizer files and
    gguf_source.json for the GGUF file; cached by (absolute path, size, mtime) so the second call
    is instant."""
    src = os.path.abspath(os.fspath(gguf_path))
    key = _cache_key(src)
    root = _cache_root(cache_dir)
    final = root / key
    if (final / _DONE).is_file():
        _remove_superseded(root, src, keep=final)
        logger.info("GGUF %s: reusing its conversion cached in %s", os.path.basename(src), final)
        return str(final)
    logger.info("GGUF %s: writing its config and tokenizer (first start only: cached in %s)",
                os.path.basename(src), final)
    start = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(root, key)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-{os.getpid()}-", dir=root))
    try:
        _convert_into(src, tmp)
        (tmp / _DONE).write_text("ok\n")
        _make_readable(tmp)
        if final.exists() and not (final / _DONE).is_file():
            shutil.rmtree(final, ignore_errors=True)  # leftover without marker: not trusted
        try:
            os.rename(tmp, final)  # atomic: readers see nothing or a complete directory
        except OSError:
            if not (final / _DONE).is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_superseded(root, src, keep=final)
    logger.info("GGUF conversion took %.1f s", time.perf_counter() - start)
    return str(final)


def _remove_superseded(root: Path, src: str, keep: Path) -> None:
    """Older conversions of the same file (it changed, or the conversion format did): nothing
    would read them again (and older formats held the whole model in float32)."""
    for entry in root.iterdir():
        meta = entry / "gguf_source.json"
        if entry == keep or entry.name.startswith(".") or not meta.is_file():
            continue
        try:
            if json.loads(meta.read_text()).get("source") == src:
                shutil.rmtree(entry, ignore_errors=True)
        except (OSError, ValueError):
            continue


def gguf_is_quantized(model_path: str) -> bool:
    """Whether `model_path` is a GGUF conversion whose source stored quantized tensors
    (Q4_K, Q8_0, ...), not only float ones."""
    meta = Path(model_path) / SOURCE_FILE
    if not meta.is_file():
        return False
    types = json.loads(meta.read_text()).get("tensor_types", [])
    return any(t not in FLOAT_TYPES for t in types)


def _make_readable(directory: Path) -> None:
    """mkdtemp (and safetensors) create owner-only entries: the conversion gets the modes the
    umask gives, as the kernel and quantization caches do, so a shared cache is readable as far
    as the umask lets it."""
    dir_mode, file_mode = umask_mode(executable=True), umask_mode()
    directory.chmod(dir_mode)
    for entry in directory.iterdir():
        entry.chmod(dir_mode if entry.is_dir() else file_mode)


def _remove_stale_tmp_dirs(root: Path, key: str) -> None:
    """Delete temp dirs of this key left by dead processes."""
    for tmp in root.glob(f".tmp-{key}-*"):
        try:
            os.kill(int(tmp.name.split("-")[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            pass


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _convert_into(src: str, out: Path) -> None:
    """Write the whole HF-style checkpoint for `src` into the (empty) directory `out`."""
    reader = open_gguf_reader(src)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {src}: pagedllm converts GGUF files of "
            f"{', '.join(SUPPORTED_GGUF_ARCHS)} (llama includes Mistral); for another architecture "
            "give its Hugging Face checkpoint (directory or Hub id) instead"
        )
    if int(_field(reader, "split.count", 1)) > 1:  # the reader would silently see one shard
        raise ValueError(f"{src} is one shard of a split GGUF; merge it with gguf-split first")
    check_tensor_types(reader.tensors, src)
    # Transformers' helpers resolve `dir/file`; link the file into `out` so they never pick up
    # unrelated tokenizer_config.json / config.json files sitting next to the GGUF.
    link = out / "_source.gguf"
    os.symlink(src, link)
    try:
        with shared_gguf_reader(reader, src):  # transformers' helpers reopen it by path
            config = _build_config(str(link), reader, arch)
            config.save_pretrained(out)
            _write_tokenizer_files(out, link.name, config)
    finally:
        link.unlink(missing_ok=True)
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    types = sorted({t.tensor_type.name for t in reader.tensors})
    meta = {"source": src, "architecture": arch, "add_bos_token": add_bos, "tensor_types": types}
    (out / SOURCE_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def _build_config(link: str, reader: Any, arch: str) -> Any:
    """HF config from the GGUF metadata, via transformers' own GGUF config mapping."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with shared_gguf_reader(config_view(reader, arch), link):
        cfg = load_gguf_checkpoint(link, return_tensors=False)["config"]
    cfg.pop("_model_name_or_path", None)
    complete_config(cfg, arch, lambda key: _field(reader, key), {t.name: t for t in reader.tensors})
    config = AutoConfig.for_model(**tidy_floats(cfg))
    config.architectures = [HF_ARCHITECTURES[config.model_type]]
    config.dtype = torch.float32
    # Some mappings (qwen2/qwen3) drop the head size and fall back to the class default.
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is not None and hasattr(config, "head_dim"):
        config.head_dim = int(head_dim)
    # Transformers leaves special ids at the config class defaults; the GGUF knows better.
    for attr, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            setattr(config, attr, int(value))
    return config


def _write_tokenizer_files(out: Path, filename: str, config: Any) -> None:
    """The tokenizer files and generation_config.json (its EOS ids come from the vocabulary)."""
    tokenizer = _build_tokenizer(out, filename, config.model_type)
    tokenizer.save_pretrained(out)
    _name_generic_tokenizer_class(out, tokenizer)
    _build_generation_config(config, tokenizer).save_pretrained(out)


def _build_tokenizer(dirname: Path, filename: str, model_type: str) -> Any:
    """Build the tokenizer directly from its class: AutoTokenizer would re-read the whole
    GGUF (another ~10 s on a 262k vocab) just to rediscover the config we already have."""
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    try:
        from transformers import TokenizersBackend
    except ImportError:  # transformers 4.x: no shortcut, pay for the extra read
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(dirname), gguf_file=filename)

    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    cls = tokenizer_class_from_name(name) if name else None
    if cls is None or name in ("MistralCommonBackend", "PythonBackend"):
        cls = TokenizersBackend
    return cls.from_pretrained(str(dirname), gguf_file=filename)


def _name_generic_tokenizer_class(out: Path, tokenizer: Any) -> None:
    """Name transformers 5's generic TokenizersBackend in tokenizer_config.json, with the
    added tokens listed there (`added_tokens_decoder`, as transformers 4 saved them).
    tokenizer.json already holds the whole tokenizer (normalizer, BOS post-processor,
    specials), but a model-specific class (GemmaTokenizer, ...) rebuilds it on every start
    from a Python parse of that file, and any class parses the whole file once more (~2 s for
    a 262k vocabulary) when the config does not list the added tokens."""
    try:
        from transformers import TokenizersBackend  # noqa: F401
    except ImportError:  # transformers 4.x: its fast classes load tokenizer.json directly
        return
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "TokenizersBackend"
    config.setdefault("added_tokens_decoder", {
        str(i): {"content": t.content, "single_word": t.single_word, "lstrip": t.lstrip, "rstrip": t.rstrip,
                 "normalized": t.normalized, "special": t.special}
        for i, t in sorted(tokenizer.added_tokens_decoder.items())
    })
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _build_generation_config(config: Any, tokenizer: Any) -> Any:
    from transformers import GenerationConfig

    eos: list[int] = [config.eos_token_id] if config.eos_token_id is not None else []
    if config.model_type == "gemma3_text" and len(tokenizer) > 106:
        if tokenizer.convert_ids_to_tokens(106) == "<end_of_turn>" and 106 not in eos:
            eos.append(106)  # chat turns end with <end_of_turn>, not <eos>
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        pad_token_id=config.pad_token_id,
    )
