"""The process groups of one engine core's ranks, and their collectives.

`init_distributed_environment` joins this process to the world (gloo on CPU, nccl on CUDA);
`initialize_model_parallel` then cuts the world (pp x tp ranks) into tensor-parallel groups of
consecutive ranks, and pipeline groups of the ranks with the same place in their stage:
rank = stage * tp + tp_rank. Layers reach their groups through `get_tp_group()` and
`get_pp_group()`.

Without an initialised process group (one rank, the default) both are groups of one whose
collectives return their input unchanged: the single-rank path never touches torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GroupCoordinator:
    """One process's view of a group of ranks: its rank in the group, the group's size, and the
    collectives over it (identities for a group of one)."""

    def __init__(self, ranks: list[int], rank: int, group: dist.ProcessGroup | None = None) -> None:
        self.ranks = ranks
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(rank)
        self.group = group

    @property
    def rank(self) -> int:
        return self.rank_in_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group, in place (x itself is returned)."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    # ---- pipeline: point to point between neighbouring stages ----
    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def isend_next(self, x: torch.Tensor) -> dist.Work:
        """Start sending `x` to the next stage; the caller keeps `x` alive until the work is done."""
        return dist.isend(x.contiguous(), self.ranks[self.rank_in_group + 1], group=self.group)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, self.ranks[self.rank_in_group - 1], group=self.group)
        return x

    def __repr__(self) -> str:
        return f"GroupCoordinator(ranks={self.ranks}, rank_in_group={self.rank_in_group})"


_SINGLE = GroupCoordinator([0], 0)
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group; a group of one until `initialize_model_parallel`."""
    return _TP if _TP is not None else _SINGLE


def get_pp_group() -> GroupCoordinator:
    """This process's pipeline group (its stage is its rank in it); a group of one by default."""
    return _PP if _PP is not None else _SINGLE


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str,
                                 backend: str | None = None) -> None:
    """Join the world of `world_size` ranks as `rank` (`distributed_init_method`: e.g.
    tcp://127.0.0.1:PORT, the same for every rank). `backend` None: nccl on CUDA, else gloo."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"torch.distributed is initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, not {rank} of {world_size}")
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=distributed_init_method, world_size=world_size, rank=rank)


def initialize_model_parallel(tensor_model_parallel_size: int, pipeline_model_parallel_size: int = 1) -> None:
    """Cut the world into tensor-parallel groups of `tensor_model_parallel_size` consecutive ranks
    and pipeline groups of every tp-th rank. Every rank creates every group (new_group is
    collective), then keeps its own."""
    global _TP, _PP
    world_size, rank = dist.get_world_size(), dist.get_rank()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if world_size != tp * pp:
        raise ValueError(f"world size {world_size} is not tensor_parallel_size {tp} x pipeline_parallel_size {pp}")
    for start in range(0, world_size, tp):
        ranks = list(range(start, start + tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TP = GroupCoordinator(ranks, rank, group)
    for first in range(tp):
        ranks = list(range(first, world_size, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            _PP = GroupCoordinator(ranks, rank, group)


def destroy_distributed_environment() -> None:
    """Leave the process groups; afterwards both groups are groups of one again."""
    global _TP, _PP
    _TP = _PP = None
    if dist.is_initialized():
        dist.destroy_process_group()
