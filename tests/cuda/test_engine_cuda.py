"""The engine on a CUDA GPU, end to end (skipped without one; `benchmarks/device_check.sh` runs
them): greedy tokens equal to transformers' in float32 on tiny Llama, Qwen3 and Gemma 3 under
prefix-cache hits, chunked prefill and preemption; CUDA-graph replay equal to eager; bf16 by
default; seeded sampling and logprobs, structured outputs, speculation, LoRA and pooling on the
device; the KV cache sized by gpu_memory_utilization after a profiling pass."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.model_executor.layers.triton_ops.test_triton_engine import check_scenario
from tests.model_executor.models.test_models import MAX_TOKENS, PROMPTS
from tests.utils import assert_idle, hf_greedy, make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def runner_of(llm):
    return llm.llm_engine.engine_core.model_executor.driver_worker.model_runner


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def tiny(request, tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp(request.param)), request.param)
    return path, hf_greedy(path, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("scenario", ["plain", "chunked", "preemption"])
def test_greedy_matches_transformers(tiny, scenario):
    check_scenario(*tiny, scenario, "cuda")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cuda_graphs_equal_eager(arch, tmp_path):
    """Seven requests decode in the bucket of eight, then fewer as they finish at different lengths."""
    path = make_tiny_model(str(tmp_path), arch)
    prompts = PROMPTS + [[9, 8, 7]]
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    results = {}
    for eager in (False, True):
        llm = LLM(path, dtype="float32", device="cuda", kv_cache_memory=1 << 26, enforce_eager=eager)
        assert (runner_of(llm).cuda_graphs is None) == eager
        results[eager] = llm.generate(prompts, params, use_tqdm=False)
        if not eager:
            assert runner_of(llm).cuda_graphs.graphs
    for g, e in zip(results[False], results[True]):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for lg, le in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            for tok, lp in le.items():
                assert abs(lg[tok].logprob - lp.logprob) < 1e-4


def test_bf16_by_default_with_seeded_sampling_and_logprobs(tiny_llama):
    llm = LLM(tiny_llama, device="cuda", kv_cache_memory=1 << 26)
    assert llm.llm_engine.config.model_config.dtype == torch.bfloat16
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, logprobs=3, ignore_eos=True)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    second = llm.generate(PROMPTS[::-1], params, use_tqdm=False)[::-1]  # another batch order
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == 12 and all(3 <= len(lp) <= 4 for lp in a.outputs[0].logprobs)
    assert_idle(llm)


def test_structured_outputs_on_the_device(tiny_llama):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    llm = LLM(tiny_llama, dtype="float32", device="cuda", kv_cache_memory=1 << 26)
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    outs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0.8, seed=1, max_tokens=40, structured_outputs=so),
                        use_tqdm=False)
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text)["a"], int)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)


def test_ngram_speculation_keeps_greedy_tokens(tiny_llama):
    prompts = [list(range(10, 30)) * 2, [5, 6, 7, 5, 6, 7, 5, 6]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(tiny_llama, dtype="float32", device="cuda", kv_cache_memory=1 << 26).generate(
        prompts, params, use_tqdm=False)
    spec = LLM(tiny_llama, dtype="float32", device="cuda", kv_cache_memory=1 << 26,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_kv_cache_follows_gpu_memory_utilization(tiny_llama):
    blocks = {}
    for util in (0.3, 0.5):
        llm = LLM(tiny_llama, device="cuda", gpu_memory_utilization=util, max_model_len=256)
        blocks[util] = llm.llm_engine.get_stats()["num_total_blocks"]
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
        llm.llm_engine.shutdown()  # its KV cache would count as in use at the next profile
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert blocks[0.5] > blocks[0.3] > 1000
