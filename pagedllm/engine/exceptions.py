"""Errors the front end can see from the engine."""


class EngineDeadError(RuntimeError):
    """The engine core process is gone; in-flight and new requests cannot complete."""

    def __init__(self, message: str = "the engine core process died; restart the server") -> None:
        super().__init__(message)
