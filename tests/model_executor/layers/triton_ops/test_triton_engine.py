"""The engine on the Triton kernels (PAGEDLLM_ATTENTION_BACKEND=triton: under Triton's
interpreter without a GPU, natively with one): greedy tokens equal to transformers' in float32
under prefix-cache hits, chunked prefill (mixed steps, sliding windows) and preemption, with
decode steps through the CUDA-graph runner's padded buckets (replayed graphs on CUDA, the same
buffers eagerly on CPU). The interpreter is slow, its cost per program (a query block of one KV
head) and layer: one architecture per scenario (tests/cuda/ runs every pair on a GPU), two layers
(gemma3's: one sliding, one full), one KV head for gemma3 and qwen3 (four query heads on it; llama
keeps two), and 8 tokens per prompt rather than test_models.py's 16: still past gemma3's sliding
window of 8 from every prompt, with decode steps that cross into a new KV block (the 27- and
43-token prompts at positions 32 and 48), and preemptions."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.model_executor.models.test_models import PROMPTS, SCENARIOS
from tests.utils import assert_greedy_match, assert_idle, hf_greedy, make_tiny_model
from tests.worker.test_kv_cache_dtype import LOGPROB_TOL

MAX_TOKENS = 8

CASES = [("llama", "plain"), ("gemma3", "chunked"), ("qwen3", "preemption")]
SHAPES = {
    "llama": dict(num_hidden_layers=2),
    "gemma3": dict(num_hidden_layers=2, num_key_value_heads=1, layer_types=["sliding_attention", "full_attention"]),
    "qwen3": dict(num_hidden_layers=2, num_key_value_heads=1, layer_types=["full_attention"] * 2),
}


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made: dict[str, tuple[str, list]] = {}

    def get(arch: str) -> tuple[str, list]:
        if arch not in made:
            path = make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch, **SHAPES[arch])
            made[arch] = (path, hf_greedy(path, PROMPTS, MAX_TOKENS))
        return made[arch]
    return get


def check_scenario(path: str, ref: list, scenario: str, device: str, tol: float = 1e-3, **engine) -> None:
    """Greedy tokens equal to `ref` (up to ties within `tol`) under SCENARIOS[scenario], decode
    steps through the CUDA-graph runner; every block free after; preemptions and prefix hits
    where the scenario makes them (a hit reads back exactly what the first run stored)."""
    llm = LLM(path, dtype="float32", device=device, **SCENARIOS[scenario], **engine)
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    assert runner.cuda_graphs is not None
    assert runner.kv_caches[0].dtype == (torch.uint8 if "kv_cache_dtype" in engine else torch.float32)
    params = SamplingParams(temperature=0, max_tokens=len(ref[0]["tokens"]), ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert_greedy_match(tokens, ref, tol=tol)
    assert_idle(llm)
    if scenario == "preemption":
        assert llm.llm_engine.get_stats()["num_preemptions"] > 0
    if scenario == "plain":
        again = llm.generate(PROMPTS[4:], params, use_tqdm=False)  # the two with a shared prefix: cache hits
        assert [list(o.outputs[0].token_ids) for o in again] == tokens[4:]
        assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0


@pytest.mark.parametrize("arch,scenario", CASES)
def test_greedy_matches_transformers(tiny, arch, scenario, device, monkeypatch):
    """gemma3's chunked run with every step's keys cut into 2 ranges (split-KV, which a GPU picks
    for a few long sequences; the kernel tests take more ranges)."""
    if arch == "gemma3":
        monkeypatch.setenv("PAGEDLLM_ATTENTION_KV_SPLITS", "2")
    check_scenario(*tiny(arch), scenario, device.type)


@pytest.mark.parametrize("arch,scenario,kv_cache_dtype", [("llama", "plain", "int8"), ("gemma3", "chunked", "fp8"),
                                                          ("qwen3", "preemption", "fp8_e5m2")])
def test_byte_cache_keeps_transformers_tokens(tiny, arch, scenario, kv_cache_dtype, device):
    """`--kv-cache-dtype` on the Triton kernels: the tokens stay with transformers' up to what a
    byte cache may move (tests/worker/test_kv_cache_dtype.py's tolerances), and the cache holds bytes."""
    check_scenario(*tiny(arch), scenario, device.type, tol=LOGPROB_TOL[kv_cache_dtype], kv_cache_dtype=kv_cache_dtype)

