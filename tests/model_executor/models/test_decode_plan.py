"""The batch-1 decode plan (decode_plan.py) against the module path it replays: the same tokens
and bit-identical logprobs, across a sliding window, in float32 and bf16, for int8 and int4
decoder linears; and where it does not apply (batches, prefill, LoRA-less but unquantized
models) the module path runs."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.models import decode_plan
from tests.utils import make_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="the plan runs pagedllm's C kernels")


@pytest.fixture(scope="module")
def gemma3_d32(tmp_path_factory) -> str:
    """tiny Gemma 3 with 32-wide heads (the kernels' multiple), sliding window 8."""
    return make_tiny_model(str(tmp_path_factory.mktemp("gemma3_d32")), "gemma3", head_dim=32, query_pre_attn_scalar=32)


def _run(llm: LLM, prompts, monkeypatch, plan: bool) -> tuple[list, int]:
    runs = []
    real_run, real_accepts = decode_plan.DecodePlan.run, decode_plan.DecodePlan.accepts
    monkeypatch.setattr(decode_plan.DecodePlan, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    monkeypatch.setattr(decode_plan.DecodePlan, "accepts", lambda self, *a: plan and real_accepts(self, *a))
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=3, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], len(runs)


@pytest.mark.parametrize("dtype, quantization", [("float32", "int8"), ("bfloat16", "int8"), ("float32", "int4")])
def test_plan_is_bit_identical_to_the_module_path(gemma3_d32, dtype, quantization, monkeypatch):
    llm = LLM(gemma3_d32, dtype=dtype, quantization=quantization, kv_cache_memory=1 << 24, block_size=8)
    prompt = [{"prompt_token_ids": [5, 17, 42, 7, 99, 3]}]  # 6 + 20 tokens: past the window of 8 and over 4 blocks
    with_plan, runs = _run(llm, prompt, monkeypatch, plan=True)
    assert runs == 19  # every decode step after the prefill's token
    without, runs = _run(llm, prompt, monkeypatch, plan=False)
    assert runs == 0
    assert with_plan == without
    # batches keep the module path; a batch's row equals its lone run (batch invariance)
    batch, runs = _run(llm, [*prompt, {"prompt_token_ids": [8, 9, 10]}], monkeypatch, plan=True)
    assert runs == 0 and batch[0] == with_plan[0]


def test_unquantized_models_keep_the_module_path(gemma3_d32, monkeypatch):
    llm = LLM(gemma3_d32, dtype="float32", kv_cache_memory=1 << 24)
    _, runs = _run(llm, [{"prompt_token_ids": [5, 17, 42]}], monkeypatch, plan=True)
    assert runs == 0
