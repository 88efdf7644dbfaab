"""Executor: the engine core's one handle on the model, however many ranks hold it.

Every call to the workers goes through `collective_rpc(method, ...)`, which runs a Worker method
on each rank and returns the results in rank order; the step methods and the start-up sequence
below are written on top of it, so an executor for more processes or machines only supplies
`collective_rpc` (and its own start and shutdown).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker process exited while the engine needed it."""


class StepFuture:
    """A step's output, fetched from the workers when first asked for."""

    __slots__ = ("_fetch", "_output")

    def __init__(self, fetch: Callable[[], ModelRunnerOutput]) -> None:
        self._fetch: Callable[[], ModelRunnerOutput] | None = fetch
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._fetch is not None:
            self._output, self._fetch = self._fetch(), None
        return self._output


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine core keeps in flight: one per pipeline stage, so no stage waits for
        the next batch while a later stage finishes the previous one."""
        return self.config.parallel_config.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose step output returns: the first rank of the last pipeline stage."""
        parallel = self.config.parallel_config
        return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model on every rank."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Run `Worker.<method>(*args, **kwargs)` on every rank; the results in rank order.
        Raises TimeoutError when a rank has not answered within `timeout` seconds."""

    # ---- start-up ---------------------------------------------------------
    def determine_available_memory(self) -> list[int]:
        """Bytes each rank gives its KV cache, in rank order."""
        return self.collective_rpc("determine_available_memory")

    def determine_num_blocks(self) -> int:
        """KV blocks every rank can hold: the minimum over ranks, since all ranks share the block
        ids (a rank's blocks hold its own kv heads of its own layers)."""
        return min(self.collective_rpc("determine_num_blocks"))

    def bytes_per_block(self) -> int:
        """KV bytes one block takes on the driver rank."""
        return self.collective_rpc("get_bytes_per_block")[0]

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def compile_or_warm_up_model(self) -> None:
        self.collective_rpc("compile_or_warm_up_model")

    # ---- one step ---------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.collective_rpc("execute_model", (scheduler_output,))

    def sample_tokens(self, grammar_output: GrammarOutput | None,
                      non_block: bool = False) -> ModelRunnerOutput | StepFuture:
        """The step's new tokens; with `non_block`, a StepFuture (the batch queue's)."""
        output = self.collective_rpc("sample_tokens", (grammar_output,))[self.output_rank]
        return StepFuture(lambda: output) if non_block else output

    def check_health(self) -> None:
        self.collective_rpc("check_health", timeout=10.0)

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers; idempotent."""


class DistributedExecutorBase(Executor):
    """An executor whose ranks run elsewhere (processes, Ray actors): a call is sent to every rank
    at once and its replies are collected later. The step's forward pass is not waited for, so
    the engine core fills the grammar bitmask while the ranks compute; with `non_block` the
    step's output is a StepFuture, and several steps can be in flight (the batch queue)."""

    _pending_forward: Any = None

    @abstractmethod
    def _send(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Send the call to every rank; a handle to collect its replies with."""

    @abstractmethod
    def _collect(self, handle: Any, timeout: float | None) -> list[Any]:
        """Every rank's reply to the call, in rank order; WorkerDiedError / TimeoutError."""

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        return self._collect(self._send(method, args, kwargs or {}), timeout)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._pending_forward = self._send("execute_model", (scheduler_output,), {})

    def sample_tokens(self, grammar_output: GrammarOutput | None,
                      non_block: bool = False) -> ModelRunnerOutput | StepFuture:
        forward, self._pending_forward = self._pending_forward, None
        sample = self._send("sample_tokens", (grammar_output,), {})

        def fetch() -> ModelRunnerOutput:
            if forward is not None:
                self._collect(forward, None)
            return self._collect(sample, None)[self.output_rank]

        return StepFuture(fetch) if non_block else fetch()
