"""Shared fixtures: tiny random-weight models and engines on them."""

from __future__ import annotations

import pytest

from tests.utils import make_tiny_model


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("gemma3")), "gemma3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="session")
def llm(tiny_gemma3):
    from pagedllm import LLM

    return LLM(tiny_gemma3, dtype="float32", kv_cache_memory=1 << 24)
