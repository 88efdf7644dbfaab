"""Run one function in a forked child process beside the caller's own work.

A GGUF conversion is Python-bound: a thread beside it holds the same GIL and gains nothing
(docs/performance.md, "Start-up"). A forked child inherits the parsed file and the config
without pickling them and runs on another core. Linux only (fork is unsafe on macOS), and not
from a daemonic process (multiprocessing forbids its children); elsewhere the caller runs the
function itself.
"""

from __future__ import annotations

import multiprocessing
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

# A child that neither finishes nor dies (a lock inherited mid-use) stops the start here.
JOIN_TIMEOUT_S = 1800.0


def fork_available() -> bool:
    return (sys.platform == "linux" and "fork" in multiprocessing.get_all_start_methods()
            and not multiprocessing.current_process().daemon)


class ForkedCall:
    """`fn()` running in a forked child from construction; `join()` waits for it and raises
    its exception (the same type, the child's traceback in a note). `kill()` stops it where
    the caller gives up first."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        ctx = multiprocessing.get_context("fork")
        self.name = name
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_run, args=(fn, send), name=name, daemon=True)
        try:
            self._proc.start()
        finally:
            send.close()  # the child holds the only writer: its exit ends recv() with EOFError

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        if not self._recv.poll(timeout):
            self.kill()
            raise RuntimeError(f"{self.name} did not finish in its child process within {timeout:.0f} s")
        try:
            error = self._recv.recv()
        except EOFError:  # died without a word (killed, out of memory)
            error = None
        self._proc.join()
        self._recv.close()
        if error is not None:
            exc, text = error
            if exc is None:  # not picklable: its text
                raise RuntimeError(f"{self.name} failed in its child process:\n{text}")
            exc.add_note(f"(raised in the child process of the {self.name}:\n{text})")
            raise exc
        if self._proc.exitcode != 0:
            raise RuntimeError(f"{self.name} failed in its child process: exit code {self._proc.exitcode}")

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._recv.close()


def _run(fn: Callable[[], Any], send: Any) -> None:
    try:
        fn()
    except BaseException as e:
        text = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(e))
            send.send((e, text))
        except Exception:  # an exception that does not survive pickling: its text only
            send.send((None, text))
        raise SystemExit(1) from None
    send.send(None)
