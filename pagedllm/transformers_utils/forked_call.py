"""Run one function in a forked child process beside the caller's own work.

A GGUF conversion is Python-bound: a thread beside it holds the same GIL and gains nothing
(docs/performance.md, "Start-up"). A forked child inherits the parsed file and the config
without pickling them and runs on another core. Linux only (fork is unsafe on macOS);
elsewhere the caller runs the function itself.
"""

from __future__ import annotations

import multiprocessing
import sys
import traceback
from collections.abc import Callable
from typing import Any


def fork_available() -> bool:
    return sys.platform == "linux" and "fork" in multiprocessing.get_all_start_methods()


class ForkedCall:
    """`fn()` running in a forked child from construction; `join()` waits for it and raises
    its error. `kill()` stops it where the caller gives up first."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        ctx = multiprocessing.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_run, args=(fn, send), name=name, daemon=True)
        self._proc.start()
        send.close()  # the child holds the only writer: its exit ends recv() with EOFError

    def join(self) -> None:
        try:
            error = self._recv.recv()
        except EOFError:  # died without a word (killed, out of memory)
            error = None
        self._proc.join()
        self._recv.close()
        if error is not None or self._proc.exitcode != 0:
            detail = error or f"exit code {self._proc.exitcode}"
            raise RuntimeError(f"{self._proc.name} failed in its child process:\n{detail}")

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._recv.close()


def _run(fn: Callable[[], Any], send: Any) -> None:
    try:
        fn()
    except BaseException:
        send.send(traceback.format_exc())
        raise SystemExit(1) from None
    send.send(None)
