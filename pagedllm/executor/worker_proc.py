"""The busy loop of a worker process: receive a call, run it on the Worker, send the result.

It leaves when told to (`shutdown_process`) or when the executor's process is gone, so a worker
never outlives its engine. The process is forked from the executor's forkserver
(multiproc_executor.py), so it watches the executor's process through multiprocessing's parent
sentinel, not its parent pid (the forkserver's).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback

import zmq

from pagedllm.config import EngineConfig
from pagedllm.envs import adopt_environment
from pagedllm.executor.serial_utils import MessageCodec
from pagedllm.logger import init_logging
from pagedllm.process_exit import exit_process
from pagedllm.worker.worker import Worker

_PARENT_CHECK_MS = 1000


def worker_main(config: EngineConfig, rank: int, broadcast_addr: str, reply_addr: str, num_threads: int,
                environ: dict[str, str]) -> None:
    """A worker process's target: the executor's environment as of the launch (the forkserver's
    is that of its own start), the loop, then the process's end (pagedllm/process_exit.py)."""
    adopt_environment(environ)
    run_worker(config, rank, broadcast_addr, reply_addr, num_threads)
    exit_process(0)


def run_worker(config: EngineConfig, rank: int, broadcast_addr: str, reply_addr: str, num_threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front, which shuts us down
    init_logging(prefix=f"(Worker rank={rank} pid={os.getpid()}) ")
    parent = multiprocessing.parent_process()
    ctx = zmq.Context()
    requests = ctx.socket(zmq.SUB)
    requests.setsockopt(zmq.RCVHWM, 0)
    requests.setsockopt(zmq.SUBSCRIBE, b"")
    requests.connect(broadcast_addr)
    replies = ctx.socket(zmq.PUSH)
    replies.connect(reply_addr)
    codec = MessageCodec()
    worker = Worker(config, rank=rank, is_driver_worker=rank == 0)
    worker.num_threads = num_threads
    try:
        while True:
            if not requests.poll(_PARENT_CHECK_MS):
                if parent is not None and not parent.is_alive():
                    return
                continue
            call_id, method, args, kwargs = codec.decode_call(requests.recv_multipart())
            if method == "shutdown_process":
                return
            try:
                reply = codec.encode_reply(call_id, rank, True, getattr(worker, method)(*args, **kwargs))
            except Exception as e:
                reply = codec.encode_reply(call_id, rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            replies.send_multipart(reply)
    finally:
        worker.shutdown()
        requests.close(linger=0)
        replies.close(linger=1000)
        ctx.term()
