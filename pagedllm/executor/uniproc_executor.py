"""UniProcExecutor: one rank, run in the engine-core process itself (the default)."""

from __future__ import annotations

from typing import Any

from pagedllm.executor.abstract import Executor
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.config, rank=0, is_driver_worker=True)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        """A direct call: in-process there is nothing to wait for, so `timeout` does not apply."""
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]

    @property
    def max_concurrent_batches(self) -> int:
        return 1  # one process: nothing runs beside the step

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
