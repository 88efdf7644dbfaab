"""The engine core in its own process, driven over ZMQ with msgspec-encoded messages.

Front → core: ADD (EngineCoreRequest), ABORT (request ids), UTILITY (call id, method, args),
SHUTDOWN. Core → front: READY / FAILED once at start, OUTPUTS (EngineCoreOutputs) after
every step that produced something, UTILITY_RESULT. The busy loop steps while there is work
and blocks on the input socket while there is none. The tags and messages are in `pagedllm.protocol`.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":  # before the imports below (torch): Ctrl-C goes to the front, which stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import logging  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402

import msgspec  # noqa: E402
import zmq  # noqa: E402

from pagedllm.engine.arg_utils import EngineArgs  # noqa: E402
from pagedllm.logger import init_logging  # noqa: E402
from pagedllm.multimodal.cache import MirroredReceiver  # noqa: E402
from pagedllm.protocol import (  # noqa: E402
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreRequest,
    EngineCoreRequestType,
)

logger = logging.getLogger("pagedllm.engine.core_proc")  # also when run as __main__


# Methods of EngineCore the front may call through UTILITY.
UTILITY_METHODS = {"get_stats", "get_scheduler_state", "reset_prefix_cache", "remove_lora"}

_IDLE_POLL_MS = 1000  # while idle: wake up this often to notice a dead parent


def run_engine_core(engine_args: EngineArgs, input_addr: str, output_addr: str) -> None:
    """Process entry point (`main`): build the core, announce READY, serve until told to stop."""
    import torch

    from pagedllm.engine.core import EngineCore
    from pagedllm.worker.worker import num_cpus

    init_logging(prefix=f"(EngineCore pid={os.getpid()}) ")
    parent_pid = os.getppid()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    start = time.perf_counter()
    try:
        # The front resolves the same arguments too (before or beside this) and logs the model cache.
        gguf_logger = logging.getLogger("pagedllm.transformers_utils.gguf_loader")
        level = gguf_logger.level
        gguf_logger.setLevel(max(gguf_logger.getEffectiveLevel(), logging.WARNING))
        try:
            config = engine_args.create_engine_config()
        finally:
            gguf_logger.setLevel(level)
        dp = config.parallel_config.data_parallel_size
        if dp > 1 and config.device_config.device.type == "cpu":
            torch.set_num_threads(max(1, num_cpus() // dp))  # the other engine cores run beside this one
        with one_cpu_left_to_the_front(config):
            core = EngineCore(config)
    except Exception as e:  # report why, so the front can raise a clear error
        out.send_multipart([EngineCoreOutputType.FAILED, encoder.encode(f"{type(e).__name__}: {e}")])
        out.close(linger=2000)
        return
    logger.info("Engine core ready in %.1f s", time.perf_counter() - start)
    out.send_multipart([EngineCoreOutputType.READY, encoder.encode(core.get_stats())])
    try:
        EngineCoreProc(core, inp, out, encoder).run_busy_loop()
    except Exception:
        logger.error("engine core crashed:\n%s", traceback.format_exc())
        raise
    finally:
        core.shutdown()
        inp.close(linger=0)
        out.close(linger=1000)
        ctx.term()
        if os.getppid() != parent_pid:  # the front died without closing: its IPC directory is ours to remove
            _remove_ipc_dir(input_addr)


@contextmanager
def one_cpu_left_to_the_front(config: Any) -> Iterator[None]:
    """One torch thread fewer while the engine core builds (one rank, on CPU): the front loads
    its tokenizer meanwhile (single-threaded, ~2 s for a 262k vocabulary). The count comes back
    after, unless the build set one of its own."""
    import torch

    threads = torch.get_num_threads()
    spare = (config.device_config.device.type == "cpu" and config.parallel_config.world_size == 1
             and threads > 1)
    if spare:
        torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        if spare and torch.get_num_threads() == threads - 1:
            torch.set_num_threads(threads)


def _remove_ipc_dir(addr: str) -> None:
    directory = os.path.dirname(addr.removeprefix("ipc://"))
    if os.path.basename(directory).startswith("pagedllm-"):
        shutil.rmtree(directory, ignore_errors=True)


class EngineCoreProc:
    def __init__(self, core: Any, inp: zmq.Socket, out: zmq.Socket, encoder: msgspec.msgpack.Encoder) -> None:
        self.core = core
        self.inp = inp
        self.out = out
        self.encoder = encoder
        self.request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.decoder = msgspec.msgpack.Decoder()
        self.parent_pid = os.getppid()
        self.running = True
        # The client's MirroredSender's counterpart: fills in the arrays of images sent before.
        self.mm_receiver = MirroredReceiver(core.config.model_config.mm_processor_cache_bytes)

    def run_busy_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        while self.running:
            # Block while idle; with work, only drain what is already queued.
            timeout = 0 if self.core.has_unfinished_requests() else _IDLE_POLL_MS
            while poller.poll(timeout):
                self._handle(self.inp.recv_multipart())
                timeout = 0
            if not self.running:
                break
            if os.getppid() != self.parent_pid:
                logger.warning("front-end process is gone; engine core exits")
                break
            if self.core.has_unfinished_requests():
                outputs = self.core.step()
                if outputs.outputs:
                    self.out.send_multipart([EngineCoreOutputType.OUTPUTS, self.encoder.encode(outputs)])

    def _handle(self, frames: list[bytes]) -> None:
        kind, payload = frames[0], frames[1] if len(frames) > 1 else b""
        if kind == EngineCoreRequestType.ADD:
            request = self.request_decoder.decode(payload)
            if request.mm_features:  # before anything can reject it: the caches must see every image
                request.mm_features = self.mm_receiver.fill(request.mm_features)
            try:
                self.core.add_request(request)
            except ValueError as e:
                logger.warning("rejected request %s: %s", request.request_id, e)
        elif kind == EngineCoreRequestType.ABORT:
            aborted = self.core.abort_requests(self.decoder.decode(payload))
            if aborted:
                outputs = EngineCoreOutputs(outputs=aborted)
                self.out.send_multipart([EngineCoreOutputType.OUTPUTS, self.encoder.encode(outputs)])
        elif kind == EngineCoreRequestType.UTILITY:
            call_id, method, args = self.decoder.decode(payload)
            try:
                if method not in UTILITY_METHODS:
                    raise ValueError(f"unknown utility method {method!r}")
                result = (True, getattr(self.core, method)(*args))
            except Exception as e:
                result = (False, f"{type(e).__name__}: {e}")
            self.out.send_multipart([EngineCoreOutputType.UTILITY_RESULT, self.encoder.encode((call_id, *result))])
        elif kind == EngineCoreRequestType.SHUTDOWN:
            self.running = False


def main() -> None:
    """`python -m pagedllm.engine.core_proc INPUT_ADDR OUTPUT_ADDR`, engine args as JSON on stdin
    (`core_launch.CoreProcess`). What every start needs is imported before the arguments are
    read: a core started ahead of its arguments (`pagedllm serve`) imports while the front does."""
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front, which shuts us down
    _preload()
    payload = sys.stdin.buffer.read()
    if not payload:  # the front went away without sending arguments (a prestarted core nobody took)
        _remove_ipc_dir(sys.argv[1])  # a front killed before it could clean up leaves it to us
        return
    engine_args = msgspec.json.decode(payload, type=EngineArgs)
    run_engine_core(engine_args, sys.argv[1], sys.argv[2])


def _preload() -> None:
    import torch  # noqa: F401

    from pagedllm.engine.core import EngineCore  # noqa: F401

    try:
        from transformers import AutoConfig  # noqa: F401  (every config is read through it)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
    from pagedllm.process_exit import exit_process

    exit_process(0)
