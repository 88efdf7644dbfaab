"""The engine-core process as the front holds it: the process, its sockets and its IPC
directory, and `close()` that releases all of it, once.

Kept free of torch (and of everything that imports it), so `pagedllm serve` can start the core
process before its own imports: the core's interpreter start and imports (torch, transformers)
run beside the front's, and the engine arguments follow on the core's stdin once they are
parsed (`prestart_core` / `take_prestarted_core`).

The object points neither at the client nor at its owner, so a client dropped without close()
is still collected, and its finalizer (or interpreter exit) releases all of it."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import zmq

from pagedllm import envs
from pagedllm.logger import LOGGING_LEVEL_ENV, level_name


class CoreProcess:
    """The engine-core process and what the front holds for it."""

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

    def launch(self) -> None:
        """Start the process. It imports, then waits for its engine arguments on stdin
        (`send_args`); it connects to the sockets only after that.

        A fresh interpreter (not fork: torch and threads do not survive it), logging as this
        one does. Not multiprocessing's spawn either: that re-imports the caller's __main__,
        which breaks scripts without an `if __name__ == "__main__"` guard."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.engine.core_proc", self.input_addr, self.output_addr],
            stdin=subprocess.PIPE, env=envs.child_env(**{LOGGING_LEVEL_ENV: level_name()}),
        )

    def send_args(self, payload: bytes) -> None:
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.close()
        except BrokenPipeError:  # it died while it waited (a prestarted core, while a GGUF converted)
            raise RuntimeError("engine core process exited during start-up "
                               f"(exit code {self.proc.wait()})") from None

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
            from pagedllm.protocol import EngineCoreRequestType

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
        if self.proc is not None and self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            if self.reader is not None and self.reader is not threading.current_thread():
                self.reader.join(2)
            self.input.close(linger=0)
            self.output.close(linger=0)
            self.ctx.term()
        finally:  # whatever failed above, the IPC directory goes
            shutil.rmtree(self.dir, ignore_errors=True)


_prestarted: CoreProcess | None = None


def prestart_core() -> None:
    """Start an engine-core process now, before this process imports torch, for the next
    single-engine client to take. One that nobody takes is stopped at exit, or by
    `discard_prestarted_core`."""
    global _prestarted
    if _prestarted is None:
        core = CoreProcess()
        try:
            core.launch()
        except BaseException:
            core.close()
            raise
        _prestarted = core
        atexit.register(discard_prestarted_core)


def take_prestarted_core() -> CoreProcess | None:
    """The prestarted core process, if one is running and nobody took it yet."""
    global _prestarted
    core, _prestarted = _prestarted, None
    if core is not None and not core.is_alive():
        core.close()
        return None
    return core


def discard_prestarted_core() -> None:
    core = take_prestarted_core()
    if core is not None:
        core.close()
