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
    from pagedllm.engine.arg_utils import EngineArgs as AsyncEngineArgs
    from pagedllm.engine.async_llm import AsyncLLM as AsyncLLMEngine
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.processor import PromptType
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.lora_request import LoRARequest
    from pagedllm.model_executor.models.registry import ModelRegistry
    from pagedllm.outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        PoolingOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import SamplingParams

# name -> "module:attribute"; vLLM's names, as `from vllm import ...` finds them. vLLM's
# AsyncLLMEngine is its AsyncLLM, which (like pagedllm's) takes the same EngineArgs.
_LAZY = {
    "LLM": "pagedllm.entrypoints.llm:LLM",
    "LLMEngine": "pagedllm.engine.llm_engine:LLMEngine",
    "AsyncLLMEngine": "pagedllm.engine.async_llm:AsyncLLM",
    "EngineArgs": "pagedllm.engine.arg_utils:EngineArgs",
    "AsyncEngineArgs": "pagedllm.engine.arg_utils:EngineArgs",
    "LoRARequest": "pagedllm.lora_request:LoRARequest",
    "ModelRegistry": "pagedllm.model_executor.models.registry:ModelRegistry",
    "PromptType": "pagedllm.engine.processor:PromptType",
    "SamplingParams": "pagedllm.sampling_params:SamplingParams",
    "PoolingParams": "pagedllm.pooling_params:PoolingParams",
    **{name: f"pagedllm.outputs:{name}" for name in (
        "RequestOutput", "CompletionOutput", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
        "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
        "ScoringRequestOutput")},
}

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLMEngine",
    "EngineArgs",
    "AsyncEngineArgs",
    "LoRARequest",
    "ModelRegistry",
    "PromptType",
    "SamplingParams",
    "PoolingParams",
    "RequestOutput",
    "CompletionOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "__version__",
]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    module, _, attribute = target.partition(":")
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
