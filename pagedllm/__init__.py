"""pagedllm: LLM inference and serving on a paged KV cache."""

from pagedllm import cpu_isa
from pagedllm.logger import init_logging

init_logging()
cpu_isa.apply()  # before torch runs anything: it reads its CPU ISA caps once

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.lora_request import LoRARequest
from pagedllm.model_executor.models.registry import ModelRegistry
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.version import __version__

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
