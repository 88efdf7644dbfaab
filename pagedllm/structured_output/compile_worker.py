"""A grammar-compiling child process: `python -m pagedllm.structured_output.compile_worker
IN_FD OUT_FD`.

xgrammar's compile runs in C++ and cannot be interrupted, so a compile that is past its time
limit, or whose requests are gone, is stopped by killing the process that runs it
(compile_pool.py). On IN_FD it reads the tokenizer info (xgrammar's JSON), then compile jobs
(kind, args, kwargs: a `GrammarCompiler.compile_<kind>` call); on OUT_FD it answers ("ready",
None) once, then ("ok", None) or ("error", message) per job. It exits when the engine closes
its end of IN_FD, or dies.

"ok" carries no grammar: the engine compiles the recipe again itself, now known to finish
within the limit. xgrammar's only transport is JSON, which for a 262k vocabulary is ~18 MB even
for a small schema and takes several times the compile to write and read.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any


def new_compiler(info: Any) -> Any:
    """One-thread compiler for xgrammar TokenizerInfo `info`, the same in the child and in the
    engine. No cache: the engine caches compiled grammars, and a cache here would hold copies."""
    import xgrammar as xgr

    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def run_recipe(compiler: Any, recipe: tuple[str, tuple, dict]) -> Any:
    """A compile job (kind, args, kwargs) as the `GrammarCompiler.compile_<kind>` call it names."""
    kind, args, kwargs = recipe
    return getattr(compiler, f"compile_{kind}")(*args, **kwargs)


def serve(recv: Connection, send: Connection) -> None:
    import xgrammar as xgr

    compiler = new_compiler(xgr.TokenizerInfo.deserialize_json(recv.recv()))
    send.send(("ready", None))
    while True:
        try:
            recipe = recv.recv()
        except EOFError:
            return
        try:
            run_recipe(compiler, recipe)
            reply = ("ok", None)
        except Exception as e:  # any compile failure is the request's, sent back as text
            reply = ("error", str(e) or type(e).__name__)
        send.send(reply)


def _exit_with_parent() -> None:
    """A compile can run for minutes without reading IN_FD: an engine that died meanwhile is
    noticed here (xgrammar releases the GIL while it compiles)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> None:
    _exit_with_parent()
    recv = Connection(int(argv[0]), writable=False)
    send = Connection(int(argv[1]), readable=False)
    try:
        serve(recv, send)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the engine is gone, or Ctrl-C reached the whole process group


if __name__ == "__main__":
    main(sys.argv[1:])
