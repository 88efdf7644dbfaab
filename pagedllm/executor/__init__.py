"""Executors: how the engine core reaches the workers that hold the model (executor/abstract.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.executor.abstract import Executor

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

__all__ = ["Executor", "executor_class"]


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor for `parallel_config.distributed_executor_backend` (vLLM's `Executor.get_class`),
    here rather than on the base class, which the executors import."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        from pagedllm.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from pagedllm.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from pagedllm.executor.ray_distributed_executor import RayDistributedExecutor

        return RayDistributedExecutor
    raise ValueError(f"distributed_executor_backend {backend!r} is not available")
