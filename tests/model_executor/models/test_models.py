"""Greedy output of every architecture equals transformers' (float32), including under
chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import assert_greedy_match, hf_greedy, make_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
MAX_TOKENS = 16  # with the longest prompts, past every tiny sliding window (8-20 tokens)
SHARED = list(range(40, 80))  # 40 tokens = 2.5 blocks of 16, shared by two prompts
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    list(range(20, 60)),
    [100, 3, 4],
    list(range(3, 30)),
    SHARED + [7, 8, 9],
    SHARED + [200, 201],
]

SCENARIOS = {
    "plain": dict(kv_cache_memory=1 << 24),
    # A budget smaller than most prompts, and chunks of at most 5 tokens a request: prefills are
    # split and mixed with decodes.
    "chunked": dict(kv_cache_memory=1 << 24, max_num_batched_tokens=8, long_prefill_token_threshold=5),
    # 9 blocks of 16 for six requests that need ~18: requests are preempted and recomputed.
    "preemption": dict(num_gpu_blocks_override=9, max_model_len=128, max_num_batched_tokens=32),
    "no_prefix_cache": dict(kv_cache_memory=1 << 24, enable_prefix_caching=False),
}


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp(request.param)), request.param)
    return path, hf_greedy(path, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers(tiny, scenario):
    path, ref = tiny
    llm = LLM(path, dtype="float32", **SCENARIOS[scenario])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_greedy_match([o.outputs[0].token_ids for o in outs], ref)
    stats = llm.llm_engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"
    if scenario == "preemption":
        assert stats["num_preemptions"] > 0
    if scenario == "plain":
        # The second run of the same prompts hits the prefix cache and still matches.
        again = llm.generate(PROMPTS, params, use_tqdm=False)
        assert_greedy_match([o.outputs[0].token_ids for o in again], ref)
        assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0
        assert any(o.num_cached_tokens > 0 for o in again)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bfloat16_matches_transformers_bfloat16(arch, tmp_path):
    """bf16 rounds differently per kernel, so only near-ties may differ (looser tolerance)."""
    import torch

    path = make_tiny_model(str(tmp_path), arch)
    ref = hf_greedy(path, PROMPTS, MAX_TOKENS, dtype=torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=1 << 24)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert_greedy_match([o.outputs[0].token_ids for o in outs], ref, tol=0.05)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_kernel_head_dim_matches_transformers(arch, dtype, tmp_path, monkeypatch):
    """head_dim 32: decode attention and the q/k norm + rotary run pagedllm's C kernels on CPU
    (the models above, at 16, take the torch paths; so does this one where the kernels are not
    built), plain and with prefills split into chunks that mix with decodes."""
    import torch

    from pagedllm.model_executor.layers import cpu_kernels

    built = cpu_kernels.kernels() is not None
    calls = {"paged_decode_attention": [], "qk_norm_rope": []}
    for name, log in calls.items():
        kernel = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _k=kernel, _log=log: _log.append(1) or _k(*a))
    extra = {"query_pre_attn_scalar": 32} if arch == "gemma3" else {}
    path = make_tiny_model(str(tmp_path), arch, head_dim=32, **extra)
    torch_dtype = getattr(torch, dtype)
    ref = hf_greedy(path, PROMPTS, MAX_TOKENS, dtype=torch_dtype)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for scenario in ("plain", "chunked"):
        llm = LLM(path, dtype=dtype, device="cpu", **SCENARIOS[scenario])
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert_greedy_match([o.outputs[0].token_ids for o in outs], ref, tol=1e-3 if dtype == "float32" else 0.05)
    assert all(calls.values()) if built else not any(calls.values()), calls
