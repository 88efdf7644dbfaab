"""The `pagedllm` logger, set up once per process in vLLM's line format
(`INFO 11-23 10:00:00 [file.py:123] message`) at the level `PAGEDLLM_LOGGING_LEVEL` names
(default INFO). The engine-core process gets the same level through its environment and the same
format, with its pid in front, so the two halves of a server read as one log.

`PAGEDLLM_CONFIGURE_LOGGING=0` leaves the `pagedllm` logger to the application. Kept free of
torch imports: `pagedllm/__init__.py` imports it first thing.
"""

from __future__ import annotations

import logging
import sys

from pagedllm import envs

LOGGING_LEVEL_ENV = "PAGEDLLM_LOGGING_LEVEL"
CONFIGURE_LOGGING_ENV = "PAGEDLLM_CONFIGURE_LOGGING"
_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"

_handler: logging.Handler | None = None


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (pytest and notebooks replace it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def init_logging(prefix: str = "") -> None:
    """Give the `pagedllm` logger its handler, format and level; later calls only change the
    prefix (the engine-core process names itself)."""
    global _handler
    if not envs.PAGEDLLM_CONFIGURE_LOGGING:
        return
    root = logging.getLogger("pagedllm")
    if _handler is None:
        _handler = _StderrHandler()
        root.addHandler(_handler)
        root.setLevel(_level_from_env())
        root.propagate = False  # an application's root handler would print every line twice
    _handler.setFormatter(logging.Formatter(prefix + _FORMAT, _DATE_FORMAT))


def _level_from_env() -> int:
    name = envs.PAGEDLLM_LOGGING_LEVEL
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        print(f"pagedllm: {LOGGING_LEVEL_ENV}={name!r} is not a logging level; using INFO", file=sys.stderr)
        return logging.INFO
    return level


def level_name() -> str:
    """The `pagedllm` logger's level, for a child process's environment."""
    return logging.getLevelName(logging.getLogger("pagedllm").getEffectiveLevel())

