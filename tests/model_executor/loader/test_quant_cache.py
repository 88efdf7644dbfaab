"""The quantized-weights cache: a second start reads what the first computed (no quantizing),
and runs the same model (identical greedy tokens and logprobs); a changed checkpoint, another
mode or PAGEDLLM_QUANT_CACHE=0 quantizes again; a damaged file is ignored and replaced."""

from __future__ import annotations

import os
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.loader import quantize
from tests.utils import make_tiny_model


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return make_tiny_model(str(tmp_path / "gemma3"), "gemma3", head_dim=32, query_pre_attn_scalar=32)


def _start(path: str, monkeypatch, quantization: str = "int4") -> tuple[list, int]:
    """Greedy tokens and logprobs, and how many weights were quantized at start-up."""
    calls = []
    real = quantize.quantize_weight
    monkeypatch.setattr(quantize, "quantize_weight", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(path, dtype="float32", quantization=quantization, kv_cache_memory=1 << 24)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 17, 42, 7]}, {"prompt_token_ids": [9] * 11}], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], len(calls)


def test_second_start_reads_the_cache(model_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache" / "quantized"
    first, quantized = _start(model_dir, monkeypatch)
    assert quantized > 0 and len(list(cache.glob("*.safetensors"))) == 1
    second, quantized = _start(model_dir, monkeypatch)
    assert quantized == 0 and second == first
    # another mode is another file
    _, quantized = _start(model_dir, monkeypatch, "int8")
    assert quantized > 0 and len(list(cache.glob("*.safetensors"))) == 2
    # a damaged file is ignored, quantized again and replaced
    (int4_file,) = [p for p in cache.glob("*.safetensors") if p.stat().st_mtime_ns == min(
        q.stat().st_mtime_ns for q in cache.glob("*.safetensors"))]
    int4_file.write_bytes(b"not a safetensors file")
    again, quantized = _start(model_dir, monkeypatch)
    assert quantized > 0 and again == first
    assert _start(model_dir, monkeypatch)[1] == 0
    # a rewritten checkpoint is a new key
    weights = next(p for p in os.listdir(model_dir) if p.endswith(".safetensors"))
    os.utime(os.path.join(model_dir, weights), ns=(1, 1))
    assert _start(model_dir, monkeypatch)[1] > 0


def test_cached_linears_are_not_read_from_the_checkpoint(model_dir, monkeypatch):
    """On a cache hit the linears' float weights come from their cached int8 values, so their
    checkpoint tensors are never read; the other weights (embedding, norms) still are."""
    from pagedllm.model_executor.layers import linear

    first, _ = _start(model_dir, monkeypatch)
    sliced = []
    real = linear.load_slice
    monkeypatch.setattr(linear, "load_slice", lambda *a, **k: sliced.append(a[-1]) or real(*a, **k))
    second, quantized = _start(model_dir, monkeypatch)
    assert quantized == 0 and second == first and sliced == []
    monkeypatch.setenv("PAGEDLLM_QUANT_CACHE", "0")
    assert _start(model_dir, monkeypatch)[0] == first and sliced


def test_row_limits_are_the_reading_process_s(model_dir, monkeypatch):
    """The cache holds weights, not the row limits: those follow the process that reads it."""
    from pagedllm.model_executor.layers.linear import Linear

    _start(model_dir, monkeypatch)
    monkeypatch.setattr(quantize, "linear_max_rows", lambda dtype: 7)
    monkeypatch.setattr(quantize, "head_int4_max_rows", lambda: 3)
    llm = LLM(model_dir, dtype="float32", quantization="int4", kv_cache_memory=1 << 24)
    model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
    linears = [m.quant for m in model.modules() if isinstance(m, Linear)]
    assert linears and {q.max_rows for q in linears} == {7}
    assert model.lm_head.quant.few_rows.max_rows == 3


def test_turned_off(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_QUANT_CACHE", "0")
    _start(model_dir, monkeypatch)
    assert _start(model_dir, monkeypatch)[1] > 0
    assert not (tmp_path / "cache" / "quantized").exists()


def test_files_unread_for_a_week_go_when_another_is_written(model_dir, tmp_path, monkeypatch):
    from pagedllm.model_executor.loader import quant_cache

    cache = tmp_path / "cache" / "quantized"
    _start(model_dir, monkeypatch)
    (used,) = cache.glob("*.safetensors")
    old = time.time() - (quant_cache.STALE_DAYS + 1) * 86400
    os.utime(used, (old, old))
    assert _start(model_dir, monkeypatch)[1] == 0  # read: marked fresh again
    assert used.stat().st_mtime > old + 86400
    stale, recent, dead_tmp = cache / "stale.safetensors", cache / "recent.safetensors", cache / ".quant-x.safetensors"
    for path, age_days in ((stale, quant_cache.STALE_DAYS + 1), (recent, quant_cache.STALE_DAYS - 1), (dead_tmp, 2)):
        path.write_bytes(b"x")
        t = time.time() - age_days * 86400
        os.utime(path, (t, t))
    _start(model_dir, monkeypatch, "int8")  # writes another file, which prunes
    names = {p.name for p in cache.glob("*.safetensors")}
    assert used.name in names and "recent.safetensors" in names and len(names) == 3
    assert not stale.exists() and not dead_tmp.exists()
