"""RayDistributedExecutor (`--distributed-executor-backend ray`): each rank a Ray actor, on
whatever machines the Ray cluster has.

The executor joins the cluster named by `RAY_ADDRESS` (or one started on this machine with
`ray start --head`), or starts a local one. It reserves a placement group of one bundle per rank
(one CPU, or one GPU on CUDA), starts an actor in each, and numbers the ranks node by node, the
driver's node first: consecutive ranks (one tensor-parallel group) share a machine, and pipeline
stages may sit on different machines. Rank 0's node hosts torch.distributed's rendezvous.

A step's message is put in Ray's object store once and every actor reads that one copy. A call
waits with a timeout; an actor that died is a `WorkerDiedError`. Shutdown kills the actors,
removes the placement group, and stops the Ray instance if this executor started it.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import GrammarOutput, SchedulerOutput
from pagedllm.executor.abstract import DistributedExecutorBase, WorkerDiedError

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install -e \".[ray]\"") from None
    return ray


class RayWorkerWrapper:
    """The body of a rank's actor: a Worker, created once the rank is known."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = None

    def get_node_and_port(self) -> tuple[str, str, int]:
        """(node id, node IP, a TCP port free there now) for rank placement and the rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port

    def init_worker(self, rank: int, distributed_init_method: str | None, num_threads: int) -> None:
        from pagedllm.worker.worker import Worker

        self.config.parallel_config.distributed_init_method = distributed_init_method
        self.worker = Worker(self.config, rank=rank, is_driver_worker=rank == 0)
        self.worker.num_threads = num_threads

    def execute_method(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Top-level arguments, so Ray resolves an object-store reference among them."""
        return getattr(self.worker, method)(*args, **kwargs)


class RayDistributedExecutor(DistributedExecutorBase):
    def _init_executor(self) -> None:
        ray = self._ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_placement_group = remove_placement_group
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            # Joins RAY_ADDRESS or a cluster started on this machine, else starts a local instance.
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        self.workers: list = []
        self.placement_group = None
        world_size = self.config.parallel_config.world_size
        on_gpu = self.config.device_config.device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
        try:
            self.placement_group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
            ready, _ = ray.wait([self.placement_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ValueError(f"the Ray cluster cannot place {world_size} ranks of {bundle} each "
                                 f"(available: {ray.available_resources()})")
            actor_cls = ray.remote(RayWorkerWrapper)
            actors = [
                actor_cls.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_group, placement_group_bundle_index=i),
                    runtime_env={"env_vars": {"OMP_NUM_THREADS": str(bundle["CPU"])}},
                ).remote(self.config)
                for i in range(world_size)
            ]
            placements = ray.get([a.get_node_and_port.remote() for a in actors])
            driver_node = ray.get_runtime_context().get_node_id()
            order = sorted(range(world_size), key=lambda i: (placements[i][0] != driver_node, placements[i][0], i))
            self.workers = [actors[i] for i in order]
            self.node_ids = [placements[i][0] for i in order]
            _, ip, port = placements[order[0]]
            init_method = f"tcp://{ip}:{port}" if world_size > 1 else None
            # A node's CPUs (as Ray counts them) shared by the ranks placed on it.
            node_cpus = {n["NodeID"]: int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n["Alive"]}
            threads = [max(1, node_cpus.get(node, 1) // self.node_ids.count(node)) for node in self.node_ids]
            ray.get([w.init_worker.remote(rank, init_method, threads[rank]) for rank, w in enumerate(self.workers)])
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def _send(self, method: str, args: tuple, kwargs: dict[str, Any]) -> tuple[str, list]:
        if args:  # one copy in the object store, read by every rank
            args = tuple(self._ray.put(a) if isinstance(a, (SchedulerOutput, GrammarOutput)) else a for a in args)
        return method, [w.execute_method.remote(method, *args, **kwargs) for w in self.workers]

    def _collect(self, handle: tuple[str, list], timeout: float | None) -> list[Any]:
        ray = self._ray
        method, refs = handle
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{method}: Ray workers did not answer within {timeout} s") from None
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(f"a Ray worker died during {method}: {e}") from None

    def shutdown(self) -> None:
        ray = getattr(self, "_ray", None)
        if ray is None or not ray.is_initialized():
            return
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
        if self.placement_group is not None:
            self._remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._started_ray:
            ray.shutdown()
