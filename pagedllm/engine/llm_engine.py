"""LLMEngine: the in-process engine for offline use and step-level control."""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest
from pagedllm.engine.processor import Processor, PromptType, fan_out
from pagedllm.model_executor.loader.tokenizer import get_eos_token_ids, get_tokenizer
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = get_tokenizer(mc.tokenizer, mc.trust_remote_code)
        self.processor = Processor(mc, self.tokenizer, get_eos_token_ids(mc.model_path, self.tokenizer))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(config)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        if request_id in self.output_processor.request_states or request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError("priority is only supported with scheduling_policy='priority'")
        request, text = self.processor.process_inputs(request_id, prompt, params, arrival_time, priority)
        op = self.output_processor
        if request.sampling_params.best_of == 1:
            op.add_request(request_id, text, request.prompt_token_ids, request.sampling_params, request.arrival_time)
            self.engine_core.add_request(request)
            return
        parent = ParentRequest(request_id, request.sampling_params)
        for i, (child_id, child) in enumerate(fan_out(request)):
            op.add_request(child_id, text, child.prompt_token_ids, child.sampling_params, request.arrival_time,
                           parent=parent, index=i)
            self.engine_core.add_request(child)

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        result = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        if result.reqs_to_abort:
            self.engine_core.abort_requests(result.reqs_to_abort)
        return result.request_outputs

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.scheduler.get_num_unfinished_requests()

    def get_stats(self) -> dict[str, float]:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()
