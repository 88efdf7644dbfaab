"""Shared fixtures: tiny random-weight models and engines on them."""

from __future__ import annotations

import glob
import os

# The suite runs two xdist workers on a 2-core machine, and every engine process it starts sizes
# its thread pool to all the cores. OpenMP's idle threads spin ~300k rounds before they sleep, so
# oversubscribed processes burn the cores the other worker needs: a model test file ran ~2x slower
# beside one busy torch process. A short spin keeps a lone run as fast and stops the burning. Set
# before torch (libgomp reads it once); the servers and workers the tests start inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# One thread per test process: the two workers then fill the two cores between them, with no
# OpenMP barrier waiting on a thread the other worker has taken. On these tiny models a second
# thread buys little: four model test files took 18% less CPU and 12% less time with one
# (106.6 s against 121.4 s, -n 2, 2026-11-29). Tests of thread counts set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without an NVIDIA GPU the Triton kernels run under Triton's CPU interpreter, in every worker:
# `triton.jit` reads this when it decorates, so it must be set before any test imports them.
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.utils import make_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """The real-model (slow) tests first: in a run split over workers by file they then overlap
    the rest instead of forming a tail at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("gemma3")), "gemma3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> str:
    """A random-weight LLaVA-1.5 with its processor (16 placeholder tokens per image)."""
    from tests.utils import make_tiny_llava

    return make_tiny_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="session")
def tiny_gemma3_mm(tmp_path_factory) -> str:
    """A random-weight Gemma 3 with images and its processor (4 soft tokens per image)."""
    from tests.utils import make_tiny_gemma3_mm

    return make_tiny_gemma3_mm(str(tmp_path_factory.mktemp("gemma3_mm")))


@pytest.fixture(scope="session")
def tiny_qwen3_think(tmp_path_factory) -> str:
    """A reasoning model's vocabulary: <think> and </think> are single tokens."""
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen3_think")), "qwen3", added_tokens=("<think>", "</think>"))


@pytest.fixture(scope="session")
def llm(tiny_gemma3):
    from pagedllm import LLM

    return LLM(tiny_gemma3, dtype="float32", kv_cache_memory=1 << 24)


@pytest.fixture(scope="module")
def tok(llm):
    """tiny_gemma3's tokenizer, from the `llm` engine."""
    return llm.get_tokenizer()


@pytest.fixture(scope="module")
def hf_model(tiny_gemma3):
    """tiny_gemma3 in transformers, float32, for reference logits."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
