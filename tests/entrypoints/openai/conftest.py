"""Fixtures for the HTTP-layer tests that need no engine: a small tokenizer and a scripted engine."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.fake_engine import FakeEngine
from tests.utils import build_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="session")
def fake_model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("fake_model"))
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def fake_tokenizer(fake_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fake_model_dir)


@pytest.fixture
def fake_engine(fake_tokenizer, fake_model_dir) -> FakeEngine:
    return FakeEngine(fake_tokenizer, fake_model_dir)
