"""The worker's hold on glibc's malloc (`cpu_malloc`): taken once by `init_device` on CPU,
given back once by `shutdown`."""

from __future__ import annotations

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker import worker as worker_module
from pagedllm.worker.worker import Worker


def test_a_cpu_worker_holds_freed_memory_from_init_device_to_shutdown(tiny_llama, monkeypatch):
    calls = []
    monkeypatch.setattr(worker_module, "keep_freed_memory", lambda: calls.append("keep") or True)
    monkeypatch.setattr(worker_module, "stop_keeping_freed_memory", lambda: calls.append("stop"))
    worker = Worker(EngineArgs(model=tiny_llama, device="cpu").create_engine_config())
    worker.init_device()
    worker.init_device()
    assert calls == ["keep"]
    worker.shutdown()
    worker.shutdown()
    assert calls == ["keep", "stop"]


def test_a_refused_hold_is_not_given_back(tiny_llama, monkeypatch):
    calls = []
    monkeypatch.setattr(worker_module, "keep_freed_memory", lambda: calls.append("keep") and False)
    monkeypatch.setattr(worker_module, "stop_keeping_freed_memory", lambda: calls.append("stop"))
    worker = Worker(EngineArgs(model=tiny_llama, device="cpu").create_engine_config())
    worker.init_device()
    worker.shutdown()
    assert calls == ["keep"]
