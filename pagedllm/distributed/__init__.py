"""Process groups and the collectives the parallel layers and pipeline stages use (parallel_state.py),
and how layers are split into stages (utils.py)."""

from pagedllm.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed_environment,
    get_pp_group,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from pagedllm.distributed.utils import get_pp_indices

__all__ = [
    "GroupCoordinator",
    "destroy_distributed_environment",
    "get_pp_group",
    "get_pp_indices",
    "get_tp_group",
    "init_distributed_environment",
    "initialize_model_parallel",
]
