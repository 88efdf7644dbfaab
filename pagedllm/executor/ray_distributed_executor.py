"""RayDistributedExecutor (`--distributed-executor-backend ray`): each rank a Ray actor, on
whatever machines the Ray cluster has.

The executor joins the cluster named by `RAY_ADDRESS` (or one started on this machine with
`ray start --head`), or starts a local one. It reserves a placement group of one bundle per rank
(one CPU, or one GPU on CUDA), starts an actor in each, and numbers the ranks node by node, the
driver's node first: consecutive ranks (one tensor-parallel group) share a machine, and pipeline
stages may sit on different machines. Rank 0's node hosts torch.distributed's rendezvous.

A step's message is put in Ray's object store once and every actor reads that one copy. A call
waits with a timeout; an actor that died is a `WorkerDiedError`. Shutdown (also on garbage
collection and at interpreter exit) kills the actors, removes the placement group, waits for the
actors' processes on this machine to be gone (SIGKILL after a bounded wait), and stops the Ray
instance if this executor started it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import GrammarOutput, SchedulerOutput
from pagedllm.executor.abstract import DistributedExecutorBase, WorkerDiedError

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0
_SHUTDOWN_WAIT_S = 5.0  # for killed actors' processes to exit, before SIGKILL
_KILL_WAIT_S = 2.0  # for SIGKILLed processes to be gone, before a warning
_POLL_S = 0.05


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

    def get_placement(self) -> tuple[str, str, int, int, float]:
        """(node id, node IP, a TCP port free there now, pid, process start time): for rank
        placement, the rendezvous, and shutdown's wait for this process to be gone."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        pid = os.getpid()
        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port, pid,
                psutil.Process(pid).create_time())

    def init_worker(self, rank: int, distributed_init_method: str | None, num_threads: int) -> None:
        from pagedllm.worker.worker import Worker

        self.config.parallel_config.distributed_init_method = distributed_init_method
        self.worker = Worker(self.config, rank=rank, is_driver_worker=rank == 0)
        self.worker.num_threads = num_threads

    def execute_method(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Top-level arguments, so Ray resolves an object-store reference among them."""
        return getattr(self.worker, method)(*args, **kwargs)


@dataclass
class _RayWorkers:
    """What shutdown releases, held apart from the executor so a finalizer can release it.
    `procs[i]` is actor i's process when it runs on this machine, else None: Ray reports an
    actor killed before its process has exited, so only a local process can be waited for."""

    ray: Any
    remove_placement_group: Callable[[Any], None]
    started_ray: bool = False
    actors: list = field(default_factory=list)
    procs: list[psutil.Process | None] = field(default_factory=list)
    placement_group: Any = None

    def close(self) -> None:
        """Returns within _SHUTDOWN_WAIT_S + _KILL_WAIT_S of waiting; a second call does nothing."""
        ray = self.ray
        actors, self.actors = self.actors, []
        procs, self.procs = [p for p in self.procs if p is not None], []
        placement_group, self.placement_group = self.placement_group, None
        # Not initialized: Ray was shut down (at exit, or by the caller), so the handles are void;
        # the processes are still waited for.
        if ray.is_initialized():
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception as e:  # an actor already gone, or a handle of an earlier session
                    logger.debug("ray.kill(%s): %s", actor, e)
            if placement_group is not None:
                try:
                    self.remove_placement_group(placement_group)
                except Exception as e:
                    logger.debug("removing the placement group: %s", e)
        left = _wait_gone(procs, _SHUTDOWN_WAIT_S)
        if left:
            logger.warning("Ray worker processes %s did not exit within %.0f s of being killed; sending SIGKILL",
                           [p.pid for p in left], _SHUTDOWN_WAIT_S)
            for proc in left:
                try:
                    proc.kill()  # psutil checks the start time first: never a reused pid
                except psutil.Error:
                    pass
            left = _wait_gone(left, _KILL_WAIT_S)
            if left:
                logger.warning("Ray worker processes %s are still alive after SIGKILL", [p.pid for p in left])
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


def _alive(proc: psutil.Process) -> bool:
    """A zombie counts as gone: it holds no memory, and its parent (the raylet) reaps it."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # not ours to inspect: alive as far as can be told
        return True


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes of `procs` still alive after up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        procs = [p for p in procs if _alive(p)]
        if not procs or time.monotonic() >= deadline:
            return procs
        time.sleep(_POLL_S)


def _local_process(pid: int, create_time: float) -> psutil.Process | None:
    """The process `pid` of this machine if it is the one that started at `create_time`, else
    None (a process on another node, or in another pid namespace)."""
    try:
        proc = psutil.Process(pid)
        return proc if abs(proc.create_time() - create_time) < 0.01 else None
    except psutil.Error:
        return None


class RayDistributedExecutor(DistributedExecutorBase):
    def _init_executor(self) -> None:
        ray = self._ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        started_ray = not ray.is_initialized()
        if started_ray:
            # Joins RAY_ADDRESS or a cluster started on this machine, else starts a local instance.
            ray.init(address=envs.RAY_ADDRESS, log_to_driver=False)
        self._workers = workers = _RayWorkers(ray, remove_placement_group, started_ray)
        self._finalizer = weakref.finalize(self, workers.close)
        self.worker_pids: list[int] = []
        world_size = self.config.parallel_config.world_size
        on_gpu = self.config.device_config.device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
        try:
            workers.placement_group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
            ready, _ = ray.wait([workers.placement_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ValueError(f"the Ray cluster cannot place {world_size} ranks of {bundle} each "
                                 f"(available: {ray.available_resources()})")
            actor_cls = ray.remote(RayWorkerWrapper)
            workers.actors = actors = [
                actor_cls.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=workers.placement_group, placement_group_bundle_index=i),
                    runtime_env={"env_vars": {"OMP_NUM_THREADS": str(bundle["CPU"])}},
                ).remote(self.config)
                for i in range(world_size)
            ]
            placements = ray.get([a.get_placement.remote() for a in actors])
            driver_node = ray.get_runtime_context().get_node_id()
            order = sorted(range(world_size), key=lambda i: (placements[i][0] != driver_node, placements[i][0], i))
            workers.actors = [actors[i] for i in order]
            workers.procs = [_local_process(*placements[i][3:]) for i in order]
            self.node_ids = [placements[i][0] for i in order]
            self.worker_pids = [placements[i][3] for i in order]
            _, ip, port, _, _ = placements[order[0]]
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

    @property
    def workers(self) -> list:
        """The ranks' actors in rank order; empty after shutdown."""
        return self._workers.actors

    @property
    def placement_group(self) -> Any:
        return self._workers.placement_group

    def shutdown(self) -> None:
        finalizer = getattr(self, "_finalizer", None)  # absent when Ray could not be imported
        if finalizer is not None:
            finalizer()
