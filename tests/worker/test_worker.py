"""The worker's hold on glibc's malloc (`cpu_malloc`): taken once by `init_device` on CPU,
given back once by `shutdown`."""

from __future__ import annotations

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker import worker as worker_module
from pagedllm.worker.worker import Worker


def _worker(tiny_llama, monkeypatch, granted: bool) -> tuple[Worker, list[str]]:
    """A CPU worker whose hold requests are recorded (and granted or refused)."""
    calls: list[str] = []
    monkeypatch.setattr(worker_module, "keep_freed_memory", lambda: calls.append("keep") or granted)
    monkeypatch.setattr(worker_module, "stop_keeping_freed_memory", lambda: calls.append("stop"))
    return Worker(EngineArgs(model=tiny_llama, device="cpu").create_engine_config()), calls


@pytest.mark.parametrize("granted, after_init, after_shutdown", [
    (True, ["keep"], ["keep", "stop"]),  # taken once however often the device is initialised
    (False, ["keep", "keep"], ["keep", "keep"]),  # refused: asked again, never given back
])
def test_a_cpu_worker_holds_freed_memory_from_init_device_to_shutdown(tiny_llama, monkeypatch, granted, after_init,
                                                                     after_shutdown):
    worker, calls = _worker(tiny_llama, monkeypatch, granted)
    worker.init_device()
    worker.init_device()
    assert calls == after_init
    worker.shutdown()
    worker.shutdown()
    assert calls == after_shutdown
