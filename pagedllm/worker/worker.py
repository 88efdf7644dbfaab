"""Worker: one rank of the model, with its device, its ModelRunner and its share of the KV cache.

An executor drives its workers only through `collective_rpc`, by these method names (vLLM's), so
the same worker runs in the engine-core process (UniProcExecutor) or in a process of its own.
"""

from __future__ import annotations

import os

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.cpu_malloc import keep_freed_memory, stop_keeping_freed_memory
from pagedllm.distributed import (
    destroy_distributed_environment,
    init_distributed_environment,
    initialize_model_parallel,
)
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, is_driver_worker: bool = True) -> None:
        self.config = config
        self.rank = rank
        self.is_driver_worker = is_driver_worker
        parallel = config.parallel_config
        # The first rank of the last pipeline stage: it samples, and its output goes back.
        self.is_output_rank = rank == (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size
        self.model_runner: ModelRunner | None = None
        # CPU threads for this rank, set by an executor that knows what else runs beside it (the
        # ranks on its node, data-parallel engine cores); None: this process's cores over its ranks.
        self.num_threads: int | None = None
        self.keeps_freed_memory = False

    def init_device(self) -> None:
        """Check that the device exists before the (slow) model load. With several ranks (each in
        a process of its own), join their process groups: each rank then builds only its shard of
        the model. On CUDA rank r takes GPU r; on CPU the ranks share the cores."""
        device = self.config.device_config.device
        parallel = self.config.parallel_config
        if device.type == "cpu":
            cpu_kernels.build_in_background()  # a first start compiles on one core while the weights load
            if not self.keeps_freed_memory:
                self.keeps_freed_memory = keep_freed_memory()
            if self.num_threads:
                torch.set_num_threads(self.num_threads)
        if parallel.world_size > 1:
            if device.type == "cuda":
                device = self.config.device_config.device = torch.device("cuda", self.rank)
            elif not self.num_threads:
                torch.set_num_threads(max(1, num_cpus() // parallel.world_size))
            init_distributed_environment(parallel.world_size, self.rank, parallel.distributed_init_method,
                                         "nccl" if device.type == "cuda" else "gloo")
            initialize_model_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        if device.type == "cuda":
            if device.index is None:  # "cuda": the current device, named, as set_device needs an index
                device = self.config.device_config.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)

    def load_model(self) -> None:
        self.model_runner = ModelRunner(self.config)

    def determine_available_memory(self) -> int:
        """Bytes this rank gives its KV cache."""
        return self.model_runner.determine_available_memory()

    def determine_num_blocks(self) -> int:
        """KV blocks this rank has room for; the executor takes the minimum over ranks."""
        return self.model_runner.determine_num_blocks()

    def get_bytes_per_block(self) -> int:
        return self.model_runner.bytes_per_block()

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def compile_or_warm_up_model(self) -> None:
        self.model_runner.warm_up()

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """The step's forward pass; `sample_tokens` finishes it."""
        self.model_runner.forward(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | None:
        """The step's new tokens; only the output rank's go back to the engine core."""
        output = self.model_runner.sample_tokens(grammar_output)
        return output if self.is_output_rank else None

    def remove_lora(self, lora_int_id: int) -> bool:
        manager = self.model_runner.lora_manager
        return manager is not None and manager.remove(lora_int_id)

    def check_health(self) -> None:
        """A worker that answers is healthy; a dead one never answers (the executor notices)."""

    def shutdown(self) -> None:
        self.model_runner = None
        if self.keeps_freed_memory:
            self.keeps_freed_memory = False
            stop_keeping_freed_memory()
        if self.config.parallel_config.world_size > 1:
            destroy_distributed_environment()


def num_cpus() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
