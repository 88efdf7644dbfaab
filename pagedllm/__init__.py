"""pagedllm: LLM inference and serving on a paged KV cache.

The public names load on first use (PEP 562), so `import pagedllm` and the command line stay
light until torch is needed: `pagedllm serve` starts its engine-core process first."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagedllm import cpu_isa
from pagedllm.logger import init_logging
from pagedllm.transformers_utils import import_cache
from pagedllm.version import __version__

init_logging()
cpu_isa.apply()  # before torch runs anything: it reads its CPU ISA caps once
import_cache.install()  # before transformers loads: its import scan is read from disk

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.lora_request import LoRARequest
    from pagedllm.model_executor.models.registry import ModelRegistry
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.sampling_params import SamplingParams

_LAZY = {
    "LLM": "pagedllm.entrypoints.llm",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "EngineArgs": "pagedllm.engine.arg_utils",
    "LoRARequest": "pagedllm.lora_request",
    "ModelRegistry": "pagedllm.model_executor.models.registry",
    "SamplingParams": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
}

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "LoRARequest",
    "ModelRegistry",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
