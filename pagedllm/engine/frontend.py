"""The front-end half shared by LLMEngine (in process) and AsyncLLM (core in another
process): tokenizer, request processing with the n / best_of fan-out, output processing."""

from __future__ import annotations

import logging
import time
from typing import Any

from pagedllm.config import LoRAConfig, ModelConfig, SchedulerConfig
from pagedllm.engine.output_processor import OutputProcessor, OutputProcessorResult, ParentRequest
from pagedllm.engine.processor import Processor, PromptType, fan_out
from pagedllm.lora.peft import check_adapter
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.protocol import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.reasoner import Reasoner
from pagedllm.transformers_utils.tokenizer import get_eos_token_ids, get_tokenizer

logger = logging.getLogger(__name__)


class Frontend:
    def __init__(self, model_config: ModelConfig, scheduler_config: SchedulerConfig,
                 reasoning_parser: str | None = None, lora_config: LoRAConfig | None = None) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        self.loras: dict[int, LoRARequest] = {}  # adapters checked against the model, by lora_int_id
        self.pooling = model_config.runner == "pooling"
        self.scheduling_policy = scheduler_config.policy
        start = time.perf_counter()
        self.tokenizer: Any = get_tokenizer(model_config.tokenizer, model_config.trust_remote_code)
        eos = get_eos_token_ids(model_config.model_path, self.tokenizer)
        logger.info("Tokenizer and config: %s, max_model_len %d, %s, vocabulary %d, in %.1f s",
                    model_config.architecture, model_config.max_model_len,
                    str(model_config.dtype).removeprefix("torch."), len(self.tokenizer), time.perf_counter() - start)
        if reasoning_parser is not None:  # a tokenizer without the parser's think tokens fails here, at start
            Reasoner.from_tokenizer(reasoning_parser, self.tokenizer)
        self.processor = Processor(model_config, self.tokenizer, eos, scheduler_config.max_n,
                                   scheduler_config.max_num_encoder_input_tokens or None)
        self.output_processor = OutputProcessor(self.tokenizer)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[EngineCoreRequest]:
        """Validate and register a request; returns the engine-core requests to submit
        (one, or one per sample for n / best_of > 1). Raises ValueError on bad input."""
        prepared = self.prepare_request(request_id, prompt, params, arrival_time, priority, cache_salt, lora_request)
        return self.register(*prepared)

    def prepare_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """The costly half of add_request (tokenizing, schema and bad-words checks): it touches
        no request state, so AsyncLLM runs it in a worker thread, off the event loop."""
        if self.pooling:
            raise ValueError("this model runs --runner pooling: it embeds, it does not generate text; start it with "
                             "--runner generate (a generation model) to generate")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError("priority is only supported with scheduling_policy='priority'")
        if lora_request is not None:
            self.add_lora(lora_request)
        request, text = self.processor.process_inputs(
            request_id, prompt, params, arrival_time, priority, cache_salt
        )
        request.lora_request = lora_request
        return request, text

    def register(self, request: EngineCoreRequest, text: str | None) -> list[EngineCoreRequest]:
        """Track a prepared request's outputs (on the thread that processes outputs); returns the
        engine-core requests to submit. A ValueError if its id is already in use."""
        op = self.output_processor
        request_id = request.request_id
        if request_id in op.request_states or request_id in op.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if request.sampling_params.best_of == 1:
            op.add_request(request_id, text, request.prompt_token_ids, request.sampling_params, request.arrival_time)
            return [request]
        parent = ParentRequest(request_id, request.sampling_params)
        children = fan_out(request)
        for i, (child_id, child) in enumerate(children):
            op.add_request(child_id, text, child.prompt_token_ids, child.sampling_params, request.arrival_time,
                           parent=parent, index=i)
        return [child for _, child in children]

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                            arrival_time: float | None = None, priority: int = 0) -> EngineCoreRequest:
        """Validate and register a request to pool (embed, encode); raises ValueError on bad input."""
        return self.register(*self.prepare_pooling_request(request_id, prompt, params, arrival_time, priority))[0]

    def prepare_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                                arrival_time: float | None = None,
                                priority: int = 0) -> tuple[EngineCoreRequest, str | None]:
        """The thread-safe half of add_pooling_request, as prepare_request."""
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError("priority is only supported with scheduling_policy='priority'")
        if not self.pooling:
            raise ValueError("this model runs --runner generate; pooling (embeddings) needs a server or LLM started "
                             "with --runner pooling (LLM(model, runner='pooling'))")
        request, text = self.processor.process_pooling_inputs(request_id, prompt, params, arrival_time)
        request.priority = priority
        return request, text

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter against the model once (files, config, targets, shapes, rank): a
        ValueError names what is wrong. Returns whether it is new."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora_config is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True (--enable-lora)")
        known = self.loras.get(lora_request.lora_int_id)
        if known is not None:
            if known.lora_path != lora_request.lora_path:
                raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already adapter {known.lora_name!r} "
                                 f"({known.lora_path}); give each adapter its own id")
            return False
        check_adapter(lora_request.lora_path, self.model_config.text_config, self.lora_config.max_lora_rank)
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.loras.pop(lora_int_id, None) is not None

    def process_outputs(self, outputs, timestamp: float) -> OutputProcessorResult:
        return self.output_processor.process_outputs(outputs, timestamp)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Forget the requests here; returns the engine-core ids to abort there."""
        return self.output_processor.abort_requests(request_ids)
