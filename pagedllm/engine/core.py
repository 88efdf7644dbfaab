"""The engine core: schedule → execute → update, one step at a time."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.interface import SchedulerInterface
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.step_stats import IterationTokens
from pagedllm.executor import executor_class
from pagedllm.executor.abstract import StepFuture
from pagedllm.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_executor = executor_class(config)(config)
        num_blocks = self.model_executor.determine_num_blocks()
        cache, sched = config.cache_config, config.scheduler_config
        capacity = num_blocks * cache.block_size
        if capacity < sched.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks), fewer than "
                f"max_model_len={sched.max_model_len}; raise kv_cache_memory or lower max_model_len"
            )
        cache.num_blocks = num_blocks
        start = time.perf_counter()
        self.model_executor.initialize_cache(num_blocks)
        blocks_per_seq = -(-sched.max_model_len // cache.block_size)
        logger.info("KV cache: %d blocks of %d tokens, %.2f GiB; maximum concurrency at max_model_len %d: "
                    "%.1f requests; in %.1f s", num_blocks, cache.block_size,
                    num_blocks * self.model_executor.bytes_per_block() / 2**30, sched.max_model_len,
                    num_blocks / blocks_per_seq, time.perf_counter() - start)
        start = time.perf_counter()
        self.model_executor.compile_or_warm_up_model()
        logger.info("Warm-up: the first forward passes in %.1f s", time.perf_counter() - start)
        self.structured_output_manager = StructuredOutputManager(
            config.model_config, config.structured_outputs_config.reasoning_parser)
        # Steps in flight, oldest first (vLLM's batch queue): up to one per pipeline stage, or
        # under async scheduling the one before the step being scheduled.
        self.batch_queue_size = self.model_executor.max_concurrent_batches
        lora = config.lora_config
        self.scheduler: SchedulerInterface = Scheduler(
            sched, cache, self.structured_output_manager, config.speculative_config,
            max_loras=lora.max_loras if lora is not None else None, pipeline_depth=self.batch_queue_size)
        self.async_scheduling = sched.async_scheduling
        self.batch_queue: deque[tuple[SchedulerOutput, StepFuture]] = deque()
        self.iteration_tokens = IterationTokens()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        finished = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [EngineCoreOutput(r.request_id, [], "abort") for r in finished]

    @property
    def pipelined(self) -> bool:
        """Pipeline parallel: `step` keeps several steps in flight and takes the oldest one's
        output only when the queue is full, so callers step this core whole rather than through
        `begin_step` / `finish_step`."""
        return self.batch_queue_size > 1

    def has_unfinished_requests(self) -> bool:
        """Requests to finish, or a step in flight whose output is still to be taken."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> EngineCoreOutputs:
        if self.pipelined:
            return self.step_with_batch_queue()
        return self.finish_step(self.begin_step())

    def _finish_oldest_step(self) -> list[EngineCoreOutput]:
        """Update from the oldest step in flight, if any. If taking its output raises, the step is
        forgotten (its tokens are lost: whoever catches the error aborts its requests, as `LLM`
        does, or the engine fails)."""
        if not self.batch_queue:
            return []
        prev_out, future = self.batch_queue.popleft()
        try:
            runner_out = future.result()
        except BaseException:
            self.scheduler.forget_step(prev_out)
            raise
        return self.scheduler.update_from_output(prev_out, runner_out)

    def _drop_oldest_step(self) -> None:
        """Wait for the oldest step in flight and forget it, its tokens unused."""
        if not self.batch_queue:
            return  # its sampling call was never sent
        prev_out, future = self.batch_queue.popleft()
        try:
            future.result()
        finally:
            self.scheduler.forget_step(prev_out)

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Keep up to `batch_queue_size` steps in flight: schedule and send a step (forward and
        sampling in one go, its grammar bitmask filled first) while earlier ones are still in
        the pipeline; once the queue is full, or nothing more can be scheduled, finish the oldest.
        A request whose step is in flight has no new token to schedule until that step ends."""
        outputs: list[EngineCoreOutput] = []
        if len(self.batch_queue) < self.batch_queue_size:
            sched_out, outputs = self.begin_step()
            if not sched_out.is_empty:
                self._send_sampling(sched_out)
                if len(self.batch_queue) < self.batch_queue_size:
                    return EngineCoreOutputs(outputs=outputs, timestamp=time.time())
        if self.batch_queue:
            outputs += self._finish_oldest_step()
        elif not outputs and self.scheduler.has_unfinished_requests():
            time.sleep(0.001)
        return EngineCoreOutputs(outputs=outputs, timestamp=time.time())

    def begin_step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """Schedule and start the forward pass. With worker processes it runs while the caller
        goes on (data-parallel engine cores in one process start theirs side by side). Under
        async scheduling this is step N + 1, sent while step N is still in flight."""
        sched_out = self.scheduler.schedule()
        if sched_out.total_num_scheduled_tokens:
            self.iteration_tokens.observe(sched_out.total_num_scheduled_tokens)
        outputs = self.scheduler.take_pending_outputs()
        if not sched_out.is_empty:
            self.model_executor.execute_model(sched_out)
        return sched_out, outputs

    def finish_step(self, begun: tuple[SchedulerOutput, list[EngineCoreOutput]]) -> EngineCoreOutputs:
        sched_out, outputs = begun
        if self.async_scheduling:
            outputs += self._finish_step_async(sched_out)
        elif not sched_out.is_empty:
            try:
                self._send_sampling(sched_out)  # its grammar bitmask is built while the forward pass runs
            except BaseException:
                self._drop_oldest_step()  # sampled without its bitmask: its tokens are not taken
                raise
            outputs += self._finish_oldest_step()
        if not outputs and sched_out.is_empty and self.scheduler.has_unfinished_requests():
            time.sleep(0.001)  # only grammars compiling: do not spin a core against the compiler
        return EngineCoreOutputs(outputs=outputs, timestamp=time.time())

    def _finish_step_async(self, sched_out: SchedulerOutput) -> list[EngineCoreOutput]:
        """Async scheduling: `begin_step` sent step N + 1's forward pass before step N's tokens
        are back (its requests' tokens from step N are placeholders, which the workers fill in
        from their own samples). Take step N's output, and only then build N + 1's grammar
        bitmask, from grammars that have seen step N's tokens. The workers (processes: see
        `check_async_scheduling`) go from one step to the next without waiting for the engine
        core's update and scheduling, and step N's tokens are out while N + 1 runs."""
        if sched_out.is_empty:
            return self._finish_oldest_step()
        outputs: list[EngineCoreOutput] = []
        self._send_sampling(sched_out, before=lambda: outputs.extend(self._finish_oldest_step()))
        return outputs

    def _send_sampling(self, sched_out: SchedulerOutput, before: Callable[[], None] | None = None) -> None:
        """Build the step's grammar bitmask (after `before`) and send its sampling call, queued
        in the batch queue. Even when that raises (e.g. Ctrl-C while `before` waits), every
        forward pass sent is followed by its sampling call, so the workers' steps stay paired."""
        grammar_output = None
        try:
            if before is not None:
                before()
            grammar_output = self.scheduler.get_grammar_output(sched_out)
        finally:
            future = self.model_executor.sample_tokens(grammar_output, non_block=True)
            self.batch_queue.append((sched_out, future))

    # ---- stats ------------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        return {**self.scheduler.make_stats(), **self.iteration_tokens.as_dict()}

    def get_scheduler_state(self) -> dict[str, Any]:
        """The dashboard's view of this core: block map, queues and progress, and its stats."""
        return {**self.scheduler.snapshot(), "stats": self.get_stats()}

    def shutdown(self) -> None:
        """Stop the workers and the grammar compiler; idempotent."""
        self.model_executor.shutdown()
        self.structured_output_manager.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def remove_lora(self, lora_int_id: int) -> bool:
        """Workers forget an adapter (a request still using it loads it again from its path)."""
        return any(self.model_executor.collective_rpc("remove_lora", args=(lora_int_id,)))
