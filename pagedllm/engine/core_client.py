"""Front-end side of the engine-core process: spawn it, send requests, receive outputs.

A reader thread owns the output socket and hands decoded messages to a callback; it
also watches the process, so a dead core is noticed within a second even when idle.
Everything to release (the process, the sockets, the IPC directory in the temp dir) sits in a
`CoreProcess` (core_launch.py) that points neither at the client nor at its owner, so a client
dropped without close() is still collected, and its finalizer (or interpreter exit) releases
all of it.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import subprocess
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_launch import CoreProcess
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.multimodal.cache import MirroredSender
from pagedllm.protocol import EngineCoreOutputs, EngineCoreOutputType, EngineCoreRequest, EngineCoreRequestType

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 900.0  # a first start converts the GGUF (~40 s here); be generous


class MPClient:
    def __init__(
        self,
        engine_args: EngineArgs,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_utility: Callable[[int, bool, Any], None],
        on_dead: Callable[[], None],
        while_starting: Callable[[], None] | None = None,
        call_ids: Iterator[int] | None = None,
        core: CoreProcess | None = None,
    ) -> None:
        """`while_starting` runs once the core process is launched, before waiting for it to be
        ready, so the caller's own loading (the tokenizer) overlaps the core's. Clients of several
        cores (data parallel) share `call_ids`, so one table of utility calls serves them all.
        `core`: a process already launched (`core_launch.prestart_core`), waiting for its
        arguments; by default one is launched here."""
        self._core = core = core if core is not None else CoreProcess()
        self._finalizer = weakref.finalize(self, core.close)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder()
        self._call_ids = call_ids if call_ids is not None else itertools.count()
        # What the core's cache of processed images holds: a repeated image's arrays are not sent again.
        self.mm_sender = MirroredSender(int(engine_args.mm_processor_cache_gb * (1 << 30)))
        try:
            core.input.bind(core.input_addr)
            core.output.bind(core.output_addr)
            if core.proc is None:
                core.launch()
            core.send_args(msgspec.json.encode(engine_args))
            if while_starting is not None:
                while_starting()
            self.ready_info = self._wait_ready()
            core.ready = True
        except BaseException:  # a failed start, or Ctrl-C / SIGTERM during it: leave nothing behind
            self.close()
            raise
        # The reader holds the callbacks weakly: it must not keep the client's owner alive.
        callbacks = [_weak(fn) for fn in (on_outputs, on_utility, on_dead)]
        core.reader = threading.Thread(target=_read_loop, args=(core, *callbacks), name="EngineCoreOutputReader",
                                       daemon=True)
        core.reader.start()

    @property
    def proc(self) -> subprocess.Popen:
        return self._core.proc

    @property
    def dead(self) -> bool:
        return self._core.dead

    def _wait_ready(self) -> dict:
        core = self._core
        poller = zmq.Poller()
        poller.register(core.output, zmq.POLLIN)
        waited = 0.0
        while waited < _STARTUP_TIMEOUT_S:
            if poller.poll(500):
                kind, payload = core.output.recv_multipart()
                if kind == EngineCoreOutputType.READY:
                    return self.decoder.decode(payload)
                if kind == EngineCoreOutputType.FAILED:
                    raise ValueError(self.decoder.decode(payload))
            if not core.is_alive():
                raise RuntimeError(f"engine core process exited during start-up (exit code {core.proc.returncode})")
            waited += 0.5
        raise RuntimeError("engine core did not start in time")

    def is_alive(self) -> bool:
        return self._core.is_alive()

    def _send(self, kind: bytes, payload: Any) -> None:
        core = self._core
        if core.dead:
            raise EngineDeadError()
        with core.send_lock:
            core.input.send_multipart([kind, self.encoder.encode(payload)])

    def add_request(self, request: EngineCoreRequest) -> None:
        if not request.mm_features:
            self._send(EngineCoreRequestType.ADD, request)
            return
        core = self._core
        if core.dead:
            raise EngineDeadError()
        with core.send_lock:  # the core receives in this order, so the two caches stay alike
            sent = dataclasses.replace(request, mm_features=self.mm_sender.strip(request.mm_features))
            core.input.send_multipart([EngineCoreRequestType.ADD, self.encoder.encode(sent)])

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self._core.dead:
            self._send(EngineCoreRequestType.ABORT, request_ids)

    def call_utility(self, method: str, *args: Any) -> int:
        call_id = next(self._call_ids)
        self._send(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        return call_id

    def close(self) -> None:
        """Stop the engine-core process (SHUTDOWN, then kill after 5 s) and release the sockets
        and the IPC directory. Idempotent; also runs when the client is collected or at exit."""
        self._finalizer()


def _weak(fn: Callable) -> Callable[[], Callable | None]:
    return weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn)


def _read_loop(core: CoreProcess, on_outputs, on_utility, on_dead) -> None:
    outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
    decoder = msgspec.msgpack.Decoder()
    poller = zmq.Poller()
    poller.register(core.output, zmq.POLLIN)
    while not core.dead:
        try:
            ready = poller.poll(500)
            if not ready:
                if not core.is_alive() and not core.dead:
                    core.dead = True
                    logger.error("engine core process died (exit code %s)", core.proc.returncode)
                    _call(on_dead)
                continue
            kind, payload = core.output.recv_multipart()
        except zmq.ZMQError:
            break  # socket closed by close()
        if kind == EngineCoreOutputType.OUTPUTS:
            _call(on_outputs, outputs_decoder.decode(payload))
        elif kind == EngineCoreOutputType.UTILITY_RESULT:
            _call(on_utility, *decoder.decode(payload))


def _call(ref: Callable[[], Callable | None], *args: Any) -> None:
    fn = ref()
    if fn is not None:  # None: the owner is gone, and the client's finalizer is closing everything
        fn(*args)
