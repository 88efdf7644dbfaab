"""MultiprocExecutor: one process per rank, each running a Worker (worker_proc.py).

The processes are forked from multiprocessing's forkserver, a clean interpreter that has
imported torch, the worker and transformers' configuration machinery once (`WORKER_PRELOAD`)
and has run nothing: a rank starts in a fraction of a second instead of paying those imports
again, and torch's thread pools are never forked. The forkserver lives as long as this process,
as multiprocessing's resource tracker does.

Each call is encoded once, with msgspec (serial_utils.py), and the same frames go to every rank;
the replies come back on one socket, tagged with the rank. While waiting, the executor watches its workers: a
rank that died becomes a `WorkerDiedError` within a poll interval, a rank that does not answer
within the call's timeout a `TimeoutError`, so nothing hangs. Shutdown (also on garbage
collection and at interpreter exit) stops the processes, killing those that do not exit, and
removes the IPC directory.
"""

from __future__ import annotations

import multiprocessing
import shutil
import socket
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Any

import zmq

from pagedllm import envs
from pagedllm.executor.abstract import DistributedExecutorBase, WorkerDiedError
from pagedllm.executor.serial_utils import MessageCodec
from pagedllm.executor.worker_proc import worker_main
from pagedllm.worker.worker import num_cpus

_POLL_MS = 100
# What the forkserver imports before it forks a worker: what every rank needs before its first call
# (transformers' config modules import its rope and validator helpers, which pull in torch.distributed.tensor).
WORKER_PRELOAD = ["pagedllm.executor.worker_proc", "transformers.configuration_utils",
                  "transformers.modeling_rope_utils", "transformers.utils.type_validators"]
_SHUTDOWN_WAIT_S = 5.0


def worker_context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its preload set (it takes effect when the server starts, at the
    first worker). Not fork: this process runs threads (zmq, torch's pools) that a fork would
    leave broken in the child."""
    mp = multiprocessing.get_context("forkserver")
    mp.set_forkserver_preload(WORKER_PRELOAD)
    return mp


@dataclass
class _Workers:
    """What shutdown releases, held apart from the executor so a finalizer can release it."""

    dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pagedllm-workers-"))
    ctx: zmq.Context = field(default_factory=zmq.Context)
    procs: list = field(default_factory=list)
    broadcast: Any = None  # XPUB: every call goes to all ranks at once
    replies: Any = None

    def close(self) -> None:
        try:
            if self.broadcast is not None:
                try:
                    self.broadcast.send_multipart(MessageCodec().encode_call(-1, "shutdown_process", (), {}),
                                                  zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            for proc in self.procs:
                proc.join(_SHUTDOWN_WAIT_S)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            for sock in [self.broadcast, self.replies]:
                if sock is not None:
                    sock.close(linger=0)
            self.ctx.term()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


class MultiprocExecutor(DistributedExecutorBase):
    def _init_executor(self) -> None:
        self._call_id = 0
        self._codec = MessageCodec()
        # call id → (method, replies so far by rank): replies to several calls may interleave
        # (the batch queue keeps steps in flight); a reply to a call not here is a late one, dropped.
        self._in_flight: dict[int, tuple[str, dict[int, tuple[bool, Any]]]] = {}
        self._workers = workers = _Workers()
        self._finalizer = weakref.finalize(self, workers.close)
        world_size = self.config.parallel_config.world_size
        if world_size > 1:  # the ranks' torch.distributed rendezvous, one port for all of them
            self.config.parallel_config.distributed_init_method = f"tcp://127.0.0.1:{_free_port()}"
        try:
            workers.replies = workers.ctx.socket(zmq.PULL)
            reply_addr = f"ipc://{workers.dir}/replies"
            workers.replies.bind(reply_addr)
            workers.broadcast = workers.ctx.socket(zmq.XPUB)
            workers.broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every rank's subscription
            workers.broadcast.setsockopt(zmq.SNDHWM, 0)  # never drop a call
            broadcast_addr = f"ipc://{workers.dir}/broadcast"
            workers.broadcast.bind(broadcast_addr)
            # This machine's cores, shared by every rank of every data-parallel engine core.
            threads = max(1, num_cpus() // (world_size * self.config.parallel_config.data_parallel_size))
            mp = worker_context()
            environ = envs.child_env()
            for rank in range(world_size):
                proc = mp.Process(target=worker_main,
                                  args=(self.config, rank, broadcast_addr, reply_addr, threads, environ),
                                  name=f"PagedllmWorker-{rank}", daemon=True)
                proc.start()
                workers.procs.append(proc)
            self._wait_for_subscribers()
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def _wait_for_subscribers(self) -> None:
        """A PUB socket drops what it sends before a subscriber has joined: wait until every rank
        has subscribed (XPUB hands over each subscription) before the first call."""
        workers = self._workers
        joined = 0
        while joined < len(workers.procs):
            if workers.broadcast.poll(_POLL_MS):
                joined += workers.broadcast.recv()[:1] == b"\x01"
                continue
            for rank, proc in enumerate(workers.procs):
                if not proc.is_alive():
                    raise WorkerDiedError(f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} "
                                          "during start-up")

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers.procs]

    def _send(self, method: str, args: tuple, kwargs: dict[str, Any]) -> int:
        self._call_id += 1
        self._in_flight[self._call_id] = (method, {})
        self._workers.broadcast.send_multipart(self._codec.encode_call(self._call_id, method, args, kwargs),
                                               copy=False)
        return self._call_id

    def _collect(self, call_id: int, timeout: float | None) -> list[Any]:
        """Every rank's reply to call `call_id`, watching the processes while waiting; replies to
        other calls in flight that arrive meanwhile are kept for them."""
        workers = self._workers
        method, replies = self._in_flight[call_id]
        waited_ms = 0
        try:
            while len(replies) < len(workers.procs):
                if workers.replies.poll(_POLL_MS):
                    frames = workers.replies.recv_multipart()
                    reply_id, rank, ok = self._codec.decode_reply_header(frames)
                    call = self._in_flight.get(reply_id)
                    if call is not None:  # else: the late answer to a call that timed out
                        call[1][rank] = (ok, self._codec.decode_reply_value(frames, call[0], ok))
                    continue
                waited_ms += _POLL_MS
                for rank, proc in enumerate(workers.procs):
                    if rank not in replies and not proc.is_alive():
                        raise WorkerDiedError(f"worker rank {rank} (pid {proc.pid}) died with exit code "
                                              f"{proc.exitcode} during {method}")
                if timeout is not None and waited_ms >= timeout * 1000:
                    missing = sorted(set(range(len(workers.procs))) - set(replies))
                    raise TimeoutError(f"{method}: worker ranks {missing} did not answer within {timeout} s")
        finally:
            self._in_flight.pop(call_id, None)
        for rank in range(len(workers.procs)):
            ok, value = replies[rank]
            if not ok:
                raise RuntimeError(f"worker rank {rank} failed in {method}: {value}")
        return [replies[rank][1] for rank in range(len(workers.procs))]

    def shutdown(self) -> None:
        self._finalizer()


def _free_port() -> int:
    """A TCP port on the loopback interface that is free now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
