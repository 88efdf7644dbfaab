"""LLMEngine: the in-process engine for offline use and step-level control.

With data parallelism it holds one engine core per rank, each with its own executor and KV
cache; requests go to the least loaded one, and a step starts every busy core's forward pass
before finishing any (with worker processes, the ranks compute side by side)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.engine.dp_balancer import DPLoadBalancer, merge_stats
from pagedllm.engine.frontend import Frontend
from pagedllm.engine.processor import PromptType
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.protocol import EngineCoreOutputs
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.frontend = Frontend(config.model_config, config.scheduler_config,
                                 config.structured_outputs_config.reasoning_parser, config.lora_config)
        self.tokenizer = self.frontend.tokenizer
        self.processor = self.frontend.processor
        self.output_processor = self.frontend.output_processor
        self.engine_cores = [EngineCore(config) for _ in range(config.parallel_config.data_parallel_size)]
        self.engine_core = self.engine_cores[0]
        self.balancer = DPLoadBalancer(len(self.engine_cores))
        # Outputs taken from the engine cores by a step that then raised: the next step returns them.
        self._undelivered: list[RequestOutput | PoolingRequestOutput] = []

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
        lora_request: LoRARequest | None = None,
    ) -> None:
        if params.logits_processors and self.config.parallel_config.distributed_executor_backend != "uni":
            raise ValueError("logits_processors are Python callables, which cannot reach worker processes; "
                             "use distributed_executor_backend='uni'")
        requests = self.frontend.add_request(request_id, prompt, params, arrival_time, priority,
                                             lora_request=lora_request)
        core = self.engine_cores[self.balancer.assign([r.request_id for r in requests])]
        for request in requests:
            core.add_request(request)

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                            arrival_time: float | None = None, priority: int = 0) -> None:
        request = self.frontend.add_pooling_request(request_id, prompt, params, arrival_time, priority)
        self.engine_cores[self.balancer.assign([request_id])].add_request(request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter against the model (a ValueError says what is wrong); requests then name it."""
        return self.frontend.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        removed = self.frontend.remove_lora(lora_int_id)
        return any([core.remove_lora(lora_int_id) for core in self.engine_cores]) or removed

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One step of every busy engine core. Without pipeline parallel, every core's forward
        pass is sent before any is waited for. If a core fails (or Ctrl-C), every forward pass
        sent still gets its sampling call, so the workers stay paired, and outputs already
        taken from the cores are returned by the next call."""
        busy = [core for core in self.engine_cores if core.has_unfinished_requests()] or self.engine_cores[:1]
        request_outputs, self._undelivered = self._undelivered, []
        finish: list[Callable[[], EngineCoreOutputs]] = []
        try:
            if busy[0].pipelined:  # each core keeps its own steps in flight
                finish = [core.step for core in busy]
            else:
                for core in busy:
                    finish.append(partial(core.finish_step, core.begin_step()))
            while finish:
                request_outputs += self._process(finish.pop(0)())
        except BaseException:
            self._undelivered = request_outputs
            for rest in [] if busy[0].pipelined else finish:
                try:
                    self._undelivered += self._process(rest())
                except Exception:
                    logger.exception("an engine core failed finishing its step after another's error")
            raise
        return request_outputs

    def _process(self, outputs: EngineCoreOutputs) -> list[RequestOutput | PoolingRequestOutput]:
        for out in outputs.outputs:
            if out.finish_reason is not None:
                self.balancer.finished(out.request_id)
        result = self.frontend.process_outputs(outputs.outputs, outputs.timestamp)
        if result.reqs_to_abort:
            self._abort_in_cores(result.reqs_to_abort)
        return result.request_outputs

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        aborted = set(ids)
        self._undelivered = [out for out in self._undelivered if out.request_id not in aborted]
        self._abort_in_cores(self.frontend.abort(ids))

    def _abort_in_cores(self, core_ids: list[str]) -> None:
        for engine, ids in self.balancer.by_engine(core_ids).items():
            self.engine_cores[engine].abort_requests(ids)
            for req_id in ids:
                self.balancer.finished(req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._undelivered) or any(core.has_unfinished_requests() for core in self.engine_cores)

    def get_num_unfinished_requests(self) -> int:
        return sum(core.scheduler.get_num_unfinished_requests() for core in self.engine_cores)

    def get_stats(self) -> dict[str, float]:
        """All engine cores together; `get_engine_stats` has them one by one."""
        return merge_stats(self.get_engine_stats())

    def get_engine_stats(self) -> list[dict[str, float]]:
        return [core.get_stats() for core in self.engine_cores]

    def reset_prefix_cache(self) -> bool:
        return all([core.reset_prefix_cache() for core in self.engine_cores])

    def shutdown(self) -> None:
        """Stop every engine core's workers: their processes, their process groups, and on CPU
        their hold on this process's malloc (`cpu_malloc`); idempotent. The engine takes no
        requests after it."""
        for core in self.engine_cores:
            core.shutdown()
