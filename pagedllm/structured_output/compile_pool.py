"""Grammar compilation in child processes (compile_worker.py), with a time limit, cancellation
and a cache.

A compile runs in xgrammar's C++ and cannot be interrupted in a thread; a process can be
killed. So each compile runs in one of `workers` child processes, and the process is killed
(then replaced) when the compile passes its time limit or when no request wants it any more
(abort, disconnect). With several processes, one slow grammar does not hold up the others;
the engine loop never waits on any of them. Requests with the same spec share one compile,
and compiled grammars are kept (least recently used evicted past `cache_bytes`).

A child answers only whether its compile succeeded; the grammar itself is then compiled again
here, in a thread (xgrammar releases the GIL), now known to finish within the limit. Sending
it over instead would cost more than compiling it twice: xgrammar's only transport is JSON,
~18 MB for a small schema against a 262k vocabulary, 0.3 s to write and 0.15 s to read where the
compile takes 0.1 s.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm import envs
from pagedllm.structured_output.compile_worker import new_compiler, run_recipe
from pagedllm.structured_output.grammar import clean_message
from pagedllm.structured_output.limits import TIMEOUT_ENV

logger = logging.getLogger(__name__)

CACHE_BYTES = 512 << 20
START_TIMEOUT_S = 120.0  # a child's interpreter start and xgrammar import
_POLL_S = 0.05
_IDLE_S = 1.0  # how often an idle loop lets go of the pool, so that it can be collected
_RESTART_DELAY_S = 5.0  # after a child failed to start


class _Job:
    __slots__ = ("key", "label", "recipe", "future", "waiters")

    def __init__(self, key: tuple, label: str, recipe: tuple) -> None:
        self.key, self.label, self.recipe = key, label, recipe
        self.future: Future = Future()
        self.waiters = 1


class Ticket:
    """One request's hold on a compile. `release()` once the request is gone: a compile
    nobody holds any more is dropped (queued) or killed (running)."""

    def __init__(self, pool: CompilePool | None, job: _Job) -> None:
        self._pool, self._job = pool, job

    def done(self) -> bool:
        return self._job.future.done()

    def result(self) -> Any:
        """The compiled grammar; ValueError with the reason if it failed."""
        return self._job.future.result(timeout=0)

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._release(self._job)


class _Worker:
    """One child process and the job it runs."""

    def __init__(self, info_json: str) -> None:
        child_in, to_child = os.pipe()
        from_child, child_out = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.structured_output.compile_worker", str(child_in), str(child_out)],
            pass_fds=(child_in, child_out), stdin=subprocess.DEVNULL, env=envs.child_env(OMP_NUM_THREADS="1"))
        os.close(child_in)
        os.close(child_out)
        self.send = Connection(to_child, readable=False)
        self.recv = Connection(from_child, writable=False)
        self.ready = False
        self.since = time.monotonic()  # start, then the current job's start
        self.job: _Job | None = None
        # The tokenizer info is megabytes: a thread writes it while the child starts.
        threading.Thread(target=self._send_quietly, args=(info_json,), daemon=True).start()

    def _send_quietly(self, message: Any) -> None:
        try:
            self.send.send(message)
        except OSError:
            pass  # the child died; its pipe's EOF reports it

    def run(self, job: _Job) -> None:
        self.job, self.since = job, time.monotonic()
        threading.Thread(target=self._send_quietly, args=(job.recipe,), daemon=True).start()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.send.close()
        self.recv.close()


class CompilePool:
    """Compiles xgrammar recipes ((kind, args, kwargs) of `GrammarCompiler.compile_<kind>`)
    against one tokenizer info, off the caller's thread."""

    def __init__(self, info: Any, workers: int, timeout_s: float, cache_bytes: int = CACHE_BYTES) -> None:
        self.info = info
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self._info_json = info.serialize_json()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queue: deque[_Job] = deque()
        self._inflight: dict[tuple, _Job] = {}
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._cached_bytes = 0
        self._procs = _Procs()
        self._local = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-local")
        self._compiler: Any = None  # xgrammar's, for the local compiles (only their thread uses it)
        self._workers: list[_Worker | None] = [self._start() for _ in range(workers)]
        self._restart_at = [0.0] * workers
        self._finalizer = weakref.finalize(self, self._procs.kill_all)
        self._thread = threading.Thread(target=_loop, args=(weakref.ref(self),), name="grammar-compile", daemon=True)
        self._thread.start()

    def submit(self, key: tuple, label: str, recipe: tuple) -> Ticket:
        """A ticket for the compile of `recipe`; `key` identifies equal recipes, `label`
        names the spec in errors (structured_outputs.json, ...)."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                job = _Job(key, label, recipe)
                job.future.set_result(self._cache[key])
                return Ticket(None, job)
            job = self._inflight.get(key)
            if job is not None:
                job.waiters += 1
                return Ticket(self, job)
            job = self._inflight[key] = _Job(key, label, recipe)
            self._queue.append(job)
        self._wake.set()
        return Ticket(self, job)

    def cache_size_bytes(self) -> int:
        return self._cached_bytes

    def close(self) -> None:
        with self._lock:
            self._procs.closed = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
        self._wake.set()
        self._thread.join(5)
        self._local.shutdown(wait=False, cancel_futures=True)
        for worker in self._workers:
            if worker is not None:
                worker.kill()
        self._finalizer()

    def _release(self, job: _Job) -> None:
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done():
                return
            job.future.cancel()  # never marked running: cancel always takes
            if self._inflight.get(job.key) is job:
                del self._inflight[job.key]
            if job in self._queue:
                self._queue.remove(job)
        self._wake.set()  # a running one: the loop kills its process

    def _start(self) -> _Worker:
        worker = _Worker(self._info_json)
        self._procs.live.add(worker.proc)
        return worker

    def _replace(self, worker: _Worker, delay_s: float = 0.0) -> None:
        """Kill the worker; its slot starts a new one after `delay_s` (a child that failed to
        start is not restarted in a tight loop)."""
        worker.kill()
        self._procs.live.discard(worker.proc)
        slot = self._workers.index(worker)
        self._workers[slot] = None
        self._restart_at[slot] = time.monotonic() + delay_s

    def _step(self) -> None:
        """One turn of the loop: restart workers, hand out jobs, take answers, kill overdue
        and abandoned compiles."""
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
            if worker is None and now >= self._restart_at[slot]:
                self._workers[slot] = self._start()
        live = [w for w in self._workers if w is not None]
        with self._lock:
            for worker in live:
                while worker.ready and worker.job is None and self._queue:
                    job = self._queue.popleft()
                    if not job.future.done():
                        worker.run(job)
            waiting = [w.recv for w in live if not w.ready or w.job is not None]
        if not waiting:
            self._wake.wait(_IDLE_S if len(live) == len(self._workers) else _POLL_S)
            self._wake.clear()
            return
        for conn in wait(waiting, timeout=_POLL_S):
            self._receive(next(w for w in live if w.recv is conn))
        self._expire()

    def _receive(self, worker: _Worker) -> None:
        try:
            status, payload = worker.recv.recv()
        except (EOFError, OSError):
            if self._procs.closed:
                return  # killed at exit
            code = worker.proc.wait()
            started = worker.ready
            what = "died" if started else "failed to start"
            logger.warning("grammar compiler process %s (exit code %s)", what, code)
            self._fail(worker, f"the grammar compiler process {what} (exit code {code})")
            self._replace(worker, 0.0 if started else _RESTART_DELAY_S)
            if not started and not any(w is not None and w.ready for w in self._workers):
                self._fail_queued(f"the grammar compiler process failed to start (exit code {code})")
            return
        if status == "ready":
            worker.ready = True
            return
        job, worker.job = worker.job, None
        if job is None:
            return
        if status == "ok":
            if not self._procs.closed:  # (a closed pool's executor takes no more work)
                self._local.submit(self._compile_here, job)
        else:
            self._finish(job, error=f"invalid {job.label}: {clean_message(payload)}")

    def _compile_here(self, job: _Job) -> None:
        """The compile a child finished, again in this process (cached even if its requests
        are gone meanwhile: a client may retry)."""
        try:
            if self._compiler is None:
                self._compiler = new_compiler(self.info)
            grammar = run_recipe(self._compiler, job.recipe)
        except Exception as e:  # the child compiled it: a failure here is still the request's
            self._finish(job, error=f"invalid {job.label}: {clean_message(str(e) or type(e).__name__)}")
            return
        self._finish(job, grammar)

    def _expire(self) -> None:
        now = time.monotonic()
        for worker in [w for w in self._workers if w is not None]:
            job = worker.job
            if not worker.ready and now - worker.since > START_TIMEOUT_S:
                logger.warning("grammar compiler process did not start within %.0f s", START_TIMEOUT_S)
                self._replace(worker, _RESTART_DELAY_S)
            elif job is not None and job.future.cancelled():
                logger.debug("grammar compile of %s cancelled: its requests are gone", job.label)
                self._replace(worker)
            elif job is not None and now - worker.since > self.timeout_s:
                logger.warning("grammar compile of %s passed its %.0f s limit", job.label, self.timeout_s)
                self._fail(worker, f"{job.label} did not compile within the limit of {self.timeout_s:g} s "
                                   f"({TIMEOUT_ENV}); use a smaller schema or grammar")
                self._replace(worker)

    def _fail(self, worker: _Worker, message: str) -> None:
        job, worker.job = worker.job, None
        if job is not None:
            self._finish(job, error=message)

    def _fail_queued(self, message: str) -> None:
        with self._lock:
            jobs, self._queue = list(self._queue), deque()
        for job in jobs:
            self._finish(job, error=message)

    def _finish(self, job: _Job, grammar: Any = None, error: str | None = None) -> None:
        with self._lock:
            if self._inflight.get(job.key) is job:
                del self._inflight[job.key]
            if grammar is not None:
                self._cache[job.key] = grammar
                self._cached_bytes += grammar.memory_size_bytes
                while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                    self._cached_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
            if job.future.done():
                return
            if error is None:
                job.future.set_result(grammar)
            else:
                job.future.set_exception(ValueError(error))


def _loop(ref: weakref.ref) -> None:
    """The pool's thread, holding the pool only while it works: a pool nobody holds is
    collected, and its finalizer kills the processes."""
    while True:
        pool = ref()
        if pool is None or pool._procs.closed:
            return
        pool._step()
        del pool


class _Procs:
    """The child processes, apart from the pool, so that a finalizer can kill them at exit."""

    def __init__(self) -> None:
        self.live: set[subprocess.Popen] = set()
        self.closed = False

    def kill_all(self) -> None:
        self.closed = True
        for proc in list(self.live):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
