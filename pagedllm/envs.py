"""Every environment variable pagedllm reads, declared once with its meaning and default
(vLLM's `vllm/envs.py`). Nothing else in the package touches `os.environ`
(tests/test_import_layers.py checks it).

`envs.PAGEDLLM_CPU_KERNELS` reads the variable when asked, not at import: a test, a CLI flag
turned into a variable, or a parent process setting one for its children all see the value of
the moment. Flags turn off with "0". Variables of other programs that pagedllm honours (the
Hugging Face hub's, glibc's, torch's) are declared in `OTHER_VARIABLES` the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _on_unless_zero(name: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "1") != "0"


def _text(name: str, default: str = "") -> Callable[[], str]:
    return lambda: os.environ.get(name, default)


def _optional(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


def cache_root() -> Path:
    """Where pagedllm keeps what it builds once per machine: see PAGEDLLM_CACHE_DIR."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache",
                                                                "pagedllm")
    return Path(root).expanduser()


environment_variables: dict[str, Callable[[], Any]] = {
    # Where pagedllm keeps what it builds once per machine (GGUF conversions, kernel builds,
    # quantized weights): this, else $XDG_CACHE_HOME/pagedllm, else ~/.cache/pagedllm.
    "PAGEDLLM_CACHE_DIR": cache_root,
    # The CPU instruction set level the kernels and torch use: avx512, avx2 or generic; unset
    # (or "auto"/"native"): the CPU's own. Lower than the CPU's emulates a smaller machine.
    "PAGEDLLM_CPU_ISA": _text("PAGEDLLM_CPU_ISA"),
    # "0": no C kernels (no compiler is looked for); every layer keeps its torch path.
    "PAGEDLLM_CPU_KERNELS": _on_unless_zero("PAGEDLLM_CPU_KERNELS"),
    # Extra gcc flags for the C kernels, e.g. "-g -fsanitize=address" to debug them.
    "PAGEDLLM_KERNEL_CFLAGS": _text("PAGEDLLM_KERNEL_CFLAGS"),
    # "0": quantized weights (--quantization, GGUF ranking copies) are made at every start
    # instead of being kept in the cache.
    "PAGEDLLM_QUANT_CACHE": _on_unless_zero("PAGEDLLM_QUANT_CACHE"),
    # "0": decode steps run the model's modules instead of the prepared per-layer plan.
    "PAGEDLLM_DECODE_PLAN": _on_unless_zero("PAGEDLLM_DECODE_PLAN"),
    # "triton": Triton's paged attention on CPU too (its interpreter); default: by device.
    "PAGEDLLM_ATTENTION_BACKEND": lambda: os.environ.get("PAGEDLLM_ATTENTION_BACKEND", "").strip().lower(),
    # How many ranges the Triton attention cuts each sequence's keys into (a power of two; "1":
    # no split-KV); default: by the GPU's SM count (triton_ops/split_kv.num_kv_splits).
    "PAGEDLLM_ATTENTION_KV_SPLITS": lambda: int(os.environ.get("PAGEDLLM_ATTENTION_KV_SPLITS") or 0),
    # Layers per pipeline stage, comma-separated (e.g. "10,8"); default: as even as possible.
    "PAGEDLLM_PP_LAYER_PARTITION": _optional("PAGEDLLM_PP_LAYER_PARTITION"),
    # Out-of-tree model classes (JSON, architecture -> "module:Class"), set by
    # `ModelRegistry.register_model` so that worker processes register them too.
    "PAGEDLLM_OOT_MODELS": _text("PAGEDLLM_OOT_MODELS"),
    # "0": freed memory goes back to the OS at once (glibc's default); otherwise the workers'
    # malloc keeps it for the next step's temporaries.
    "PAGEDLLM_KEEP_FREED_MEMORY": _on_unless_zero("PAGEDLLM_KEEP_FREED_MEMORY"),
    # "0": a GGUF's tensors are read through whatever pages its page cache holds; otherwise the
    # mapping is advised for 2 MiB pages, and a file cached in 4 KiB pages is read in again
    # (transformers_utils/page_cache.py).
    "PAGEDLLM_HUGE_PAGE_WEIGHTS": _on_unless_zero("PAGEDLLM_HUGE_PAGE_WEIGHTS"),
    # "0": GGUF Q4_K / Q6_K / Q5_0 / Q4_0 linears run from the file's own layout instead of repacked 8 rows at a
    # time at load (model_executor/layers/gguf_linear.py, csrc/gguf_x8.c); for comparisons.
    "PAGEDLLM_GGUF_REPACK": _on_unless_zero("PAGEDLLM_GGUF_REPACK"),
    # "0": a pre-quantized checkpoint's float LM head runs its float weight (oneDNN-packed) instead of
    # int4 / W8A8 ranking copies with its top candidates re-scored (loader/quantize.py); for comparisons.
    "PAGEDLLM_RANK_FLOAT_HEAD": _on_unless_zero("PAGEDLLM_RANK_FLOAT_HEAD"),
    # "0": pagedllm leaves its logger unconfigured (an application sets the handlers).
    "PAGEDLLM_CONFIGURE_LOGGING": _on_unless_zero("PAGEDLLM_CONFIGURE_LOGGING"),
    # The `pagedllm` logger's level (DEBUG, INFO, WARNING, ...); default INFO.
    "PAGEDLLM_LOGGING_LEVEL": lambda: os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").strip().upper() or "INFO",
    # The key `pagedllm serve` requires (as --api-key) and `pagedllm chat|complete` send.
    "PAGEDLLM_API_KEY": _optional("PAGEDLLM_API_KEY"),
    # Grammar compiler processes per engine core (a positive integer; default 2).
    "PAGEDLLM_GRAMMAR_COMPILE_WORKERS": _optional("PAGEDLLM_GRAMMAR_COMPILE_WORKERS"),
    # Seconds one grammar may take to compile before its request fails (positive; default 60).
    "PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT_S": _optional("PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT_S"),
    # "1"/"true": /v1/load_lora_adapter and /v1/unload_lora_adapter are served (vLLM's variable of
    # the same meaning).
    "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING":
        lambda: os.environ.get("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true"),
    # Seconds one image URL may take to fetch (vLLM's VLLM_IMAGE_FETCH_TIMEOUT); default 5.
    "PAGEDLLM_MEDIA_FETCH_TIMEOUT": _optional("PAGEDLLM_MEDIA_FETCH_TIMEOUT"),
}

OTHER_VARIABLES: dict[str, Callable[[], Any]] = {
    # The C compiler for the kernels (default gcc).
    "CC": _text("CC", "gcc"),
    # The Hugging Face hub: offline mode ("1", "true", ...; None: the hub library's default)
    # and its cache directory.
    "HF_HUB_OFFLINE": _optional("HF_HUB_OFFLINE"),
    "HF_HUB_CACHE": _optional("HF_HUB_CACHE"),
    # The Ray cluster to join (default: start one, or the one `ray start` left running).
    "RAY_ADDRESS": _optional("RAY_ADDRESS"),
    # "1": Triton kernels run in its interpreter (on CPU).
    "TRITON_INTERPRET": lambda: os.environ.get("TRITON_INTERPRET") == "1",
    # The key `pagedllm chat|complete` send when PAGEDLLM_API_KEY is unset.
    "OPENAI_API_KEY": _optional("OPENAI_API_KEY"),
    # glibc malloc settings: set by the user, pagedllm leaves malloc alone.
    "GLIBC_TUNABLES": _text("GLIBC_TUNABLES"),
    "MALLOC_MMAP_MAX_": _optional("MALLOC_MMAP_MAX_"),
    "MALLOC_MMAP_THRESHOLD_": _optional("MALLOC_MMAP_THRESHOLD_"),
    "MALLOC_TRIM_THRESHOLD_": _optional("MALLOC_TRIM_THRESHOLD_"),
    "MALLOC_TOP_PAD_": _optional("MALLOC_TOP_PAD_"),
    # torch's and oneDNN's instruction set caps, which PAGEDLLM_CPU_ISA sets where unset.
    "ATEN_CPU_CAPABILITY": _optional("ATEN_CPU_CAPABILITY"),
    "DNNL_MAX_CPU_ISA": _optional("DNNL_MAX_CPU_ISA"),
}


def __getattr__(name: str) -> Any:
    getter = environment_variables.get(name) or OTHER_VARIABLES.get(name)
    if getter is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getter()


def __dir__() -> list[str]:
    return sorted([*globals(), *environment_variables, *OTHER_VARIABLES])


def _declared(name: str) -> str:
    if name not in environment_variables and name not in OTHER_VARIABLES:
        raise KeyError(f"{name} is not declared in pagedllm/envs.py")
    return name


def is_set(name: str) -> bool:
    """Whether the declared variable `name` is set at all (even to "")."""
    return _declared(name) in os.environ


def set_variable(name: str, value: str) -> None:
    """Set a declared variable for this process and the processes it starts."""
    os.environ[_declared(name)] = value


def set_default(name: str, value: str) -> None:
    """Set a declared variable where the user has not."""
    os.environ.setdefault(_declared(name), value)


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment with `overrides`, for a child process."""
    return {**os.environ, **overrides}


def adopt_environment(environ: dict[str, str]) -> None:
    """Make `environ` this process's environment: a process forked from a server that started
    earlier (the workers' forkserver) takes its launcher's environment as of the launch."""
    os.environ.clear()
    os.environ.update(environ)


def pagedllm_settings() -> dict[str, str]:
    """The PAGEDLLM_* variables that are set, as set (`pagedllm collect-env` shows them)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("PAGEDLLM_")}
