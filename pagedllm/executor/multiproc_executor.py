"""MultiprocExecutor: one spawned process per rank, each running a Worker (worker_proc.py).

Each call is encoded once (`encode_call`) and the same bytes go to every rank; the replies come
back on one socket, tagged with the rank. While waiting, the executor watches its workers: a
rank that died becomes a `WorkerDiedError` within a poll interval, a rank that does not answer
within the call's timeout a `TimeoutError`, so nothing hangs. Shutdown (also on garbage
collection and at interpreter exit) stops the processes, killing those that do not exit, and
removes the IPC directory.
"""

from __future__ import annotations

import multiprocessing
import pickle
import shutil
import socket
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Any

import zmq

from pagedllm.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor, WorkerDiedError
from pagedllm.executor.worker_proc import run_worker

_POLL_MS = 100
_SHUTDOWN_WAIT_S = 5.0


def encode_call(call_id: int, method: str, args: tuple, kwargs: dict[str, Any]) -> bytes:
    """The one place a call (a step's SchedulerOutput included) is serialized for the workers.
    Replies carry the call's id, so a late reply to a call that timed out is recognised and dropped."""
    return pickle.dumps((call_id, method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)


@dataclass
class _Workers:
    """What shutdown releases, held apart from the executor so a finalizer can release it."""

    dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pagedllm-workers-"))
    ctx: zmq.Context = field(default_factory=zmq.Context)
    procs: list = field(default_factory=list)
    requests: list = field(default_factory=list)  # one PUSH socket per rank
    replies: Any = None

    def close(self) -> None:
        try:
            for sock in self.requests:
                try:
                    sock.send(encode_call(-1, "shutdown_process", (), {}), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            for proc in self.procs:
                proc.join(_SHUTDOWN_WAIT_S)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            for sock in [*self.requests, self.replies]:
                if sock is not None:
                    sock.close(linger=0)
            self.ctx.term()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        self._call_id = 0
        self._pending_forward: int | None = None
        self._workers = workers = _Workers()
        self._finalizer = weakref.finalize(self, workers.close)
        world_size = self.config.parallel_config.world_size
        if world_size > 1:  # the ranks' torch.distributed rendezvous, one port for all of them
            self.config.parallel_config.distributed_init_method = f"tcp://127.0.0.1:{_free_port()}"
        try:
            workers.replies = workers.ctx.socket(zmq.PULL)
            reply_addr = f"ipc://{workers.dir}/replies"
            workers.replies.bind(reply_addr)
            spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: torch does not survive fork
            for rank in range(world_size):
                sock = workers.ctx.socket(zmq.PUSH)
                addr = f"ipc://{workers.dir}/rank{rank}"
                sock.bind(addr)
                workers.requests.append(sock)
                proc = spawn.Process(target=run_worker, args=(self.config, rank, addr, reply_addr),
                                     name=f"PagedllmWorker-{rank}", daemon=True)
                proc.start()
                workers.procs.append(proc)
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers.procs]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        return self._collect(self._send(method, args, kwargs or {}), method, timeout)

    # ---- one step: the forward pass is not waited for, so the engine core fills the grammar
    # bitmask while the workers compute, and the step makes one round trip less.
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._pending_forward = self._send("execute_model", (scheduler_output,), {})

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        if self._pending_forward is not None:
            call_id, self._pending_forward = self._pending_forward, None
            self._collect(call_id, "execute_model", None)
        return self.collective_rpc("sample_tokens", (grammar_output,))[0]

    def _send(self, method: str, args: tuple, kwargs: dict[str, Any]) -> int:
        self._call_id += 1
        message = encode_call(self._call_id, method, args, kwargs)
        for sock in self._workers.requests:
            sock.send(message, copy=False)
        return self._call_id

    def _collect(self, call_id: int, method: str, timeout: float | None) -> list[Any]:
        """Every rank's reply to call `call_id`, watching the processes while waiting."""
        workers = self._workers
        results: dict[int, Any] = {}
        errors: list[str] = []
        waited_ms = 0
        while len(results) < len(workers.procs):
            if workers.replies.poll(_POLL_MS):
                reply_id, rank, ok, value = pickle.loads(workers.replies.recv())
                if reply_id != call_id:
                    continue  # the late answer to an earlier call that timed out
                results[rank] = value
                if not ok:  # still collect the other ranks' replies, so none is left for the next call
                    errors.append(f"worker rank {rank} failed in {method}: {value}")
                continue
            waited_ms += _POLL_MS
            for rank, proc in enumerate(workers.procs):
                if rank not in results and not proc.is_alive():
                    raise WorkerDiedError(f"worker rank {rank} (pid {proc.pid}) died with exit code "
                                          f"{proc.exitcode} during {method}")
            if timeout is not None and waited_ms >= timeout * 1000:
                missing = sorted(set(range(len(workers.procs))) - set(results))
                raise TimeoutError(f"{method}: worker ranks {missing} did not answer within {timeout} s")
        if errors:
            raise RuntimeError(errors[0])
        return [results[rank] for rank in range(len(workers.procs))]

    def shutdown(self) -> None:
        self._finalizer()


def _free_port() -> int:
    """A TCP port on the loopback interface that is free now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
