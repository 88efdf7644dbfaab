"""What the engine core asks of a scheduler (vLLM's `SchedulerInterface`). The engine core, and
everything else outside `core/`, goes through these methods only and never reads a scheduler's
fields (tests/test_import_layers.py checks it), so a scheduler keeps its queues, groups and KV
cache manager to itself."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.protocol import EngineCoreOutput


class SchedulerInterface(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError when its id belongs to a request not finished yet."""

    @abstractmethod
    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests wherever they are (an abort); the ones it ended. Unknown ids are ignored."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """The next step: which requests compute how many tokens, in which blocks."""

    @abstractmethod
    def get_grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The step's structured-output bitmask for the requests that sample in it (None: none
        of them has a grammar in force). Built after `schedule()`, while the forward pass runs."""

    @abstractmethod
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply a finished step's tokens; the outputs for the front."""

    @abstractmethod
    def forget_step(self, scheduler_output: SchedulerOutput) -> None:
        """A step whose output is lost: its requests no longer wait for it."""

    @abstractmethod
    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        """Outputs made outside a step (a grammar that failed to compile), once."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def make_stats(self) -> dict[str, float]:
        """Queue sizes, KV cache usage, prefix-cache and preemption counters (and speculative
        decoding's and the adapters', where on) for the metrics."""

    @abstractmethod
    def snapshot(self) -> dict[str, Any]:
        """The live dashboard's plain-data view: the KV block map and the queues."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while requests hold blocks."""
