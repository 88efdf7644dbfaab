"""EngineClient: what the OpenAI server needs from an engine (as vLLM's engine/protocol.py).
AsyncLLM implements it; the HTTP-layer tests pass a scripted engine that does too."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol, runtime_checkable

from pagedllm.config import LoRAConfig, ModelConfig
from pagedllm.engine.processor import PromptType
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    model_config: ModelConfig

    @property
    def is_running(self) -> bool:
        """Started, not shut down, and not errored."""
        ...

    @property
    def errored(self) -> bool:
        """The engine died: every request from now on fails with EngineDeadError."""
        ...

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """An async generator (`async def ... yield`) of cumulative RequestOutputs, the last
        with finished=True; closing it early aborts the request."""
        ...

    def encode(
        self, prompt: PromptType, pooling_params: PoolingParams, request_id: str, priority: int = 0,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling engine's vector for the prompt (one finished output); a generation engine
        raises ValueError saying how to start a pooling one."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def get_tokenizer(self) -> Any: ...

    def expand_image_placeholders(self, token_ids: list[int], images: list[Any]) -> list[int]:
        """A prompt's token ids with each image placeholder expanded as the engine expands it
        (what /tokenize counts); blocking. Too many or unreadable images: a ValueError."""
        ...

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine is gone."""
        ...

    async def get_stats(self) -> dict[str, float]:
        """The engine's stats; with data parallelism, all its engine cores together."""
        ...

    async def get_engine_stats(self) -> list[dict[str, float]]:
        """The same stats, one entry per (data-parallel) engine core."""
        ...

    async def get_scheduler_state(self) -> list[dict[str, Any]]:
        """Per engine core: its KV block map, queues with each request's progress, and its stats
        (pagedllm.core.scheduler_state), as plain data."""
        ...

    async def reset_prefix_cache(self) -> bool: ...

    @property
    def lora_config(self) -> LoRAConfig | None:
        """None when the engine runs without --enable-lora."""
        ...

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter against the model (ValueError saying what is wrong); whether it is new."""
        ...

    async def remove_lora(self, lora_int_id: int) -> bool: ...

    def shutdown(self) -> None: ...
