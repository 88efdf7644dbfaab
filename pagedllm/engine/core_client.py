"""Front-end side of the engine-core process: spawn it, send requests, receive outputs.

A reader thread owns the output socket and hands decoded messages to a callback; it
also watches the process, so a dead core is noticed within a second even when idle.
Everything to release (the process, the sockets, the IPC directory in the temp dir) sits in a
`_CoreProcess` that points neither at the client nor at its owner, so a client dropped without
close() is still collected, and its finalizer (or interpreter exit) releases all of it.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.logger import LOGGING_LEVEL_ENV, level_name
from pagedllm.protocol import EngineCoreOutputs, EngineCoreOutputType, EngineCoreRequest, EngineCoreRequestType

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 900.0  # a first start converts the GGUF (~40 s here); be generous


class _CoreProcess:
    """The engine-core process and what the front holds for it; close() releases all of it, once."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="pagedllm-")
        self.input_addr = f"ipc://{os.path.join(self.dir, 'input')}"
        self.output_addr = f"ipc://{os.path.join(self.dir, 'output')}"
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.output = self.ctx.socket(zmq.PULL)
        self.send_lock = threading.Lock()  # zmq sockets are not thread-safe
        self.proc: subprocess.Popen | None = None
        self.reader: threading.Thread | None = None
        self.ready = False  # READY received: the core reads SHUTDOWN; before, it is still loading
        self.dead = False  # set by close(), or by the reader when the process died
        self.closed = False

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        closing_live_core = self.is_alive()
        self.dead = True  # from here on, the core exiting is expected, not a death to report
        if closing_live_core and not self.ready:
            self.proc.kill()  # an abandoned start: nothing to finish
            self.proc.wait(5)
        elif closing_live_core:
            try:
                with self.send_lock:
                    self.input.send_multipart([EngineCoreRequestType.SHUTDOWN, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        try:
            if self.reader is not None and self.reader is not threading.current_thread():
                self.reader.join(2)
            self.input.close(linger=0)
            self.output.close(linger=0)
            self.ctx.term()
        finally:  # whatever failed above, the IPC directory goes
            shutil.rmtree(self.dir, ignore_errors=True)


class MPClient:
    def __init__(
        self,
        engine_args: EngineArgs,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_utility: Callable[[int, bool, Any], None],
        on_dead: Callable[[], None],
        while_starting: Callable[[], None] | None = None,
        call_ids: Iterator[int] | None = None,
    ) -> None:
        """`while_starting` runs once the core process is launched, before waiting for it to be
        ready, so the caller's own loading (the tokenizer) overlaps the core's. Clients of several
        cores (data parallel) share `call_ids`, so one table of utility calls serves them all."""
        self._core = core = _CoreProcess()
        self._finalizer = weakref.finalize(self, core.close)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder()
        self._call_ids = call_ids if call_ids is not None else itertools.count()
        try:
            core.input.bind(core.input_addr)
            core.output.bind(core.output_addr)
            # A fresh interpreter (not fork: torch and threads do not survive it), logging as this one does.
            core.proc = subprocess.Popen(
                [sys.executable, "-m", "pagedllm.engine.core_proc", core.input_addr, core.output_addr],
                stdin=subprocess.PIPE, env={**os.environ, LOGGING_LEVEL_ENV: level_name()},
            )
            core.proc.stdin.write(msgspec.json.encode(engine_args))
            core.proc.stdin.close()
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
        self._send(EngineCoreRequestType.ADD, request)

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


def _read_loop(core: _CoreProcess, on_outputs, on_utility, on_dead) -> None:
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
