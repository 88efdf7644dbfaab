"""`kv_cache_dtype` through the engine (kv_quant.py): tiny float32 Llama and Gemma 3 keep
transformers' greedy tokens (up to near-ties) with their logprobs close; the same memory holds
about 4x the blocks of a float32 cache; a prefix hit and a preemption read back what was stored;
and the settings the byte cache cannot serve are refused."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from tests.utils import assert_greedy_match, hf_greedy, make_tiny_model

PROMPTS = [[5, 17, 42, 7, 99, 3], list(range(20, 45)), [8] * 3 + list(range(60, 70))]
MAX_TOKENS = 16
# What a byte cache may move a logprob by on these models (their logits are near-flat, so a
# few hundredths decide a token), and the tie tolerance of the token checks: fp8 keeps 3 mantissa
# bits (e4m3) or 2 (e5m2).
LOGPROB_TOL = {"int8": 0.02, "fp8": 0.15, "fp8_e5m2": 0.3}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, list[dict]]]:
    """Each tiny model (32-wide heads, the C kernels' multiple; Gemma 3 with its sliding window
    of 8) with transformers' greedy reference."""
    made = {}
    for arch in ("llama", "gemma3"):
        path = make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch, head_dim=32,
                               **({"query_pre_attn_scalar": 32} if arch == "gemma3" else {}))
        made[arch] = (path, hf_greedy(path, PROMPTS, MAX_TOKENS))
    return made


def _generate(llm: LLM, prompts, max_tokens: int = MAX_TOKENS):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [
        [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_tokens_and_logprobs_stay_with_transformers(models, arch, kv_cache_dtype):
    path, ref = models[arch]
    llm = LLM(path, dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 22, block_size=8)
    tokens, logprobs = _generate(llm, PROMPTS)
    tol = LOGPROB_TOL[kv_cache_dtype]
    assert_greedy_match(tokens, ref, tol=tol)
    for got, lps, r in zip(tokens, logprobs, ref):
        for pos, (t, lp) in enumerate(zip(got, lps)):
            if t != r["tokens"][pos]:
                break
            assert abs(lp - float(r["logprobs"][pos][t])) < tol


def test_the_same_memory_holds_four_times_the_blocks_of_float32(models):
    path = models["llama"][0]
    blocks = {}
    for kv in ("auto", "int8"):
        llm = LLM(path, dtype="float32", kv_cache_dtype=kv, kv_cache_memory=1 << 22, block_size=8)
        blocks[kv] = llm.llm_engine.engine_cores[0].config.cache_config.num_blocks
        del llm
    # per token and kv head: 32 floats (128 bytes) against 32 bytes + a float32 scale
    assert blocks["int8"] == pytest.approx(blocks["auto"] * 128 / 36, abs=1)


def test_prefix_hits_and_preemption_read_back_the_stored_values(models):
    """A prompt found in the cache reads its stored bytes where the first run read its own K/V
    back from the cache: the same values, so the same tokens. A cache too small for both requests
    preempts one, which recomputes into fresh blocks and still gets its lone run's tokens."""
    path = models["gemma3"][0]
    llm = LLM(path, dtype="float32", kv_cache_dtype="int8", kv_cache_memory=1 << 22, block_size=8)
    long = [list(range(20, 60))]
    first, _ = _generate(llm, long)
    hits = llm.llm_engine.get_stats()["prefix_cache_hits"]
    hit, _ = _generate(llm, long)
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > hits
    assert hit == first
    small = LLM(path, dtype="float32", kv_cache_dtype="int8", num_gpu_blocks_override=10, block_size=8,
                max_model_len=64, enable_prefix_caching=False)
    prompts = [list(range(20, 45)), list(range(50, 75))]
    both, _ = _generate(small, prompts, max_tokens=30)
    assert small.llm_engine.get_stats()["num_preemptions"] >= 1
    alone = [_generate(small, [p], max_tokens=30)[0][0] for p in prompts]
    assert both == alone


@pytest.mark.parametrize("args, match", [
    ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype must be one of"),
])
def test_refused_settings(models, args, match, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=models["llama"][0], **args).create_engine_config()
