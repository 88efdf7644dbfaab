"""Process groups and the collectives the tensor-parallel layers use (parallel_state.py)."""

from pagedllm.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed_environment,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)

__all__ = [
    "GroupCoordinator",
    "destroy_distributed_environment",
    "get_tp_group",
    "init_distributed_environment",
    "initialize_model_parallel",
]
