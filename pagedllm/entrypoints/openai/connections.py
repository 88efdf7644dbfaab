"""Connection hygiene for the HTTP server: the open-file limit, a header timeout, shedding
connections past a cap, and accept errors logged at most once a second.

Without these, ~20k idle connections that never finish their headers hold every file
descriptor; the server then can accept nobody, and asyncio logs each failed accept."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# Descriptors kept back for the engine's sockets, model files, logs, the tokenizer.
FD_RESERVE = 256
_SHED_BODY = (b'{"error":{"message":"too many open connections","type":"service_unavailable_error",'
              b'"param":null,"code":503}}')
_SHED_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
                  b"content-length: %d\r\n\r\n" % len(_SHED_BODY)) + _SHED_BODY


def raise_open_file_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (each connection is a descriptor); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            logger.warning("could not raise the open-file limit from %d to %d", soft, target)
    return soft


def default_connection_limit(open_file_limit: int) -> int:
    return max(16, open_file_limit - FD_RESERVE)


class RateLimitedLog:
    """One log line per `interval` seconds, counting the ones it swallowed."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.last = -float("inf")
        self.suppressed = 0

    def __call__(self, level: int, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last < self.interval:
            self.suppressed += 1
            return
        if self.suppressed:
            msg += f" ({self.suppressed} more like this in the last {now - self.last:.1f} s)"
        self.last, self.suppressed = now, 0
        logger.log(level, msg, *args)


_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def install_accept_error_throttle(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio reports each failed accept() through the loop's exception handler; report
    descriptor exhaustion at most once a second, with a count, and everything else as before."""
    throttle = RateLimitedLog()
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            throttle(logging.ERROR, "accept failed: %s; new connections wait until descriptors free up",
                     exc.strerror or exc)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    _one_accept_retry_per_socket(loop)


def _one_accept_retry_per_socket(loop: asyncio.AbstractEventLoop) -> None:
    """CPython's selector loop, when accept() fails for want of descriptors, schedules a retry
    (`_start_serving`, a second later) for each of the `backlog` accepts it tries in that tick:
    2048 under uvicorn. Each retry re-arms the listening socket, so the retries multiply every
    second, and once the socket is closed each fails with a traceback, holding shutdown up for
    seconds. One armed socket is enough: a retry for a socket that is closed or already armed
    is dropped. Loops without the method (uvloop) are left as they are."""
    start = getattr(loop, "_start_serving", None)
    selector = getattr(loop, "_selector", None)
    if start is None or selector is None:
        return

    def start_serving(protocol_factory: Any, sock: Any, *args: Any, **kwargs: Any) -> None:
        fd = sock.fileno()
        if fd == -1 or fd in selector.get_map():
            return
        start(protocol_factory, sock, *args, **kwargs)

    loop._start_serving = start_serving  # type: ignore[attr-defined]


def guarded_protocol(max_connections: int, header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, plus: past `max_connections` open connections a new one gets a
    503 and is closed at once (the server sheds, rather than running out of descriptors), and
    a connection that has not sent a complete request head within `header_timeout` seconds of
    connecting, or of its previous response, is closed."""
    shed_log = RateLimitedLog()

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                shed_log(logging.WARNING, "more than %d open connections: shedding new ones (--limit-concurrency)",
                         max_connections)
                transport.write(_SHED_RESPONSE)
                transport.close()
                return
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout, self._header_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            waiting_for_head = self.cycle is None or self.cycle.response_complete
            if waiting_for_head and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._cancel_header_timer()  # a request head arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol
