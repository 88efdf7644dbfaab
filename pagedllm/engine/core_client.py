"""Front-end side of the engine-core process: spawn it, send requests, receive outputs.

A reader thread owns the output socket and hands decoded messages to a callback; it
also watches the process, so a dead core is noticed within a second even when idle.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineArgs
from pagedllm.core.request import EngineCoreRequest
from pagedllm.engine import EngineCoreOutputs
from pagedllm.engine.core_proc import (
    ABORT,
    ADD,
    FAILED,
    OUTPUTS,
    READY,
    SHUTDOWN,
    UTILITY,
    UTILITY_RESULT,
)
from pagedllm.engine.exceptions import EngineDeadError

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 900.0  # a first start converts the GGUF (~40 s here); be generous


class MPClient:
    def __init__(
        self,
        engine_args: EngineArgs,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_utility: Callable[[int, bool, Any], None],
        on_dead: Callable[[], None],
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="pagedllm-")
        input_addr = f"ipc://{os.path.join(self._dir, 'input')}"
        output_addr = f"ipc://{os.path.join(self._dir, 'output')}"
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(input_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.decoder = msgspec.msgpack.Decoder()
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe
        self._call_ids = itertools.count()
        self.on_outputs, self.on_utility, self.on_dead = on_outputs, on_utility, on_dead
        self.dead = False

        # A fresh interpreter (not fork: torch and threads do not survive it).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.engine.core_proc", input_addr, output_addr], stdin=subprocess.PIPE
        )
        self.proc.stdin.write(msgspec.json.encode(engine_args))
        self.proc.stdin.close()
        self.ready_info = self._wait_ready()
        self._reader = threading.Thread(target=self._read_loop, name="EngineCoreOutputReader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> dict:
        poller = zmq.Poller()
        poller.register(self.output, zmq.POLLIN)
        waited = 0.0
        while waited < _STARTUP_TIMEOUT_S:
            if poller.poll(500):
                kind, payload = self.output.recv_multipart()
                if kind == READY:
                    return self.decoder.decode(payload)
                if kind == FAILED:
                    self.close()
                    raise ValueError(self.decoder.decode(payload))
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"engine core process exited during start-up (exit code {self.proc.returncode})")
            waited += 0.5
        self.close()
        raise RuntimeError("engine core did not start in time")

    def _read_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.output, zmq.POLLIN)
        while not self.dead:
            try:
                ready = poller.poll(500)
            except zmq.ZMQError:
                break  # socket closed by shutdown
            if not ready:
                if not self.is_alive():
                    self.dead = True
                    logger.error("engine core process died (exit code %s)", self.proc.returncode)
                    self.on_dead()
                continue
            kind, payload = self.output.recv_multipart()
            if kind == OUTPUTS:
                self.on_outputs(self.outputs_decoder.decode(payload))
            elif kind == UTILITY_RESULT:
                self.on_utility(*self.decoder.decode(payload))

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def _send(self, kind: bytes, payload: Any) -> None:
        if self.dead:
            raise EngineDeadError()
        with self._send_lock:
            self.input.send_multipart([kind, self.encoder.encode(payload)])

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead:
            self._send(ABORT, request_ids)

    def call_utility(self, method: str, *args: Any) -> int:
        call_id = next(self._call_ids)
        self._send(UTILITY, (call_id, method, list(args)))
        return call_id

    def close(self) -> None:
        closing_live_core = getattr(self, "proc", None) is not None and self.is_alive()
        self.dead = True  # from here on, the core exiting is expected, not a death to report
        if closing_live_core:
            try:
                with self._send_lock:
                    self.input.send_multipart([SHUTDOWN, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(2)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
