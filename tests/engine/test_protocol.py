"""AsyncLLM implements EngineClient (engine/protocol.py), checked without starting an engine."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.protocol import EngineClient

COROUTINES = ("abort", "check_health", "get_stats", "get_engine_stats", "get_scheduler_state", "reset_prefix_cache",
              "add_lora", "remove_lora")


def _bare_engine() -> AsyncLLM:
    """An AsyncLLM with the state its protocol members read, but no engine-core process."""
    engine = object.__new__(AsyncLLM)
    engine.model_config = SimpleNamespace(max_model_len=64)
    engine.errored = False
    engine.client = SimpleNamespace(dead=False)
    engine.clients = [engine.client]
    engine.tokenizer = object()
    engine.config = SimpleNamespace(lora_config=None)
    return engine


def test_async_llm_is_an_engine_client():
    engine = _bare_engine()
    assert isinstance(engine, EngineClient)
    assert engine.is_running and engine.get_tokenizer() is engine.tokenizer
    engine.client.dead = True  # shut down, or the core process died
    assert not engine.is_running
    engine.client.dead, engine.errored = False, True
    assert not engine.is_running


def test_async_llm_members_match_the_protocol():
    assert inspect.isasyncgenfunction(AsyncLLM.generate) and inspect.isasyncgenfunction(AsyncLLM.encode)
    assert inspect.signature(AsyncLLM.encode) == inspect.signature(EngineClient.encode)
    assert inspect.signature(AsyncLLM.generate) == inspect.signature(EngineClient.generate)
    for name in COROUTINES:
        assert inspect.iscoroutinefunction(getattr(AsyncLLM, name)), name
        assert inspect.signature(getattr(AsyncLLM, name)) == inspect.signature(getattr(EngineClient, name)), name
    assert isinstance(inspect.getattr_static(AsyncLLM, "is_running"), property)
    assert not inspect.iscoroutinefunction(AsyncLLM.shutdown)
