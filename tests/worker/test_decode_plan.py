"""The decode plans (decode_plan.py) against the module path they replay: the same tokens and
bit-identical logprobs, alone and in batches of several rows (each row equal to its lone run),
across a sliding window, in float32 and bf16, for int8, int4 and fp8 decoder linears, for each layer
recipe (Gemma 3's; the pre-norm Llama layers of Llama and Qwen3, with its q/k norm); and where
they do not apply (prefill, more rows than a plan takes, unquantized models, a layer that
computes otherwise) the module path runs."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.loader.quantize import linear_max_rows
from pagedllm.worker import decode_plan
from tests.model_executor.models.test_llama_variants import make_variant
from tests.utils import make_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="the plan runs pagedllm's C kernels")


@pytest.fixture(scope="module")
def gemma3_d32(tmp_path_factory) -> str:
    """tiny Gemma 3 with 32-wide heads (the kernels' multiple), sliding window 8."""
    return make_tiny_model(str(tmp_path_factory.mktemp("gemma3_d32")), "gemma3", head_dim=32, query_pre_attn_scalar=32)


@pytest.fixture(scope="module")
def llama_family_d32(tmp_path_factory):
    """tiny Llama and Qwen3 (q/k norm) models with 32-wide heads."""
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = make_tiny_model(str(tmp_path_factory.mktemp(f"{arch}_d32")), arch, head_dim=32)
        return made[arch]
    return get


_REAL_RUN, _REAL_TAKES = decode_plan.DecodePlan.run, decode_plan.DecodePlans.takes


def _run(llm: LLM, prompts, monkeypatch, plan: bool, max_tokens=20, chunks: list | None = None) -> tuple:
    """Outputs, and the row count of each step the plans ran (in `chunks`: whether it had a
    prompt chunk)."""
    runs = []
    real_run, real_takes = _REAL_RUN, _REAL_TAKES  # not the last call's wrappers

    def run(self, input_ids, positions, md):
        runs.append(self.rows)
        if chunks is not None:
            chunks.append(bool(md.prefills))
        return real_run(self, input_ids, positions, md)

    monkeypatch.setattr(decode_plan.DecodePlan, "run", run)
    monkeypatch.setattr(decode_plan.DecodePlans, "takes", lambda self, *a: plan and real_takes(self, *a))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=3, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], runs


@pytest.mark.parametrize("dtype, quantization", [("float32", "int8"), ("bfloat16", "int8"), ("float32", "int4"),
                                                 ("float32", "fp8")])
def test_plan_is_bit_identical_to_the_module_path(gemma3_d32, dtype, quantization, monkeypatch):
    # No prefix caching: a prompt found in the cache computes its last tokens on another attention path.
    llm = LLM(gemma3_d32, dtype=dtype, quantization=quantization, kv_cache_memory=1 << 24, block_size=8,
              enable_prefix_caching=False)
    prompt = [{"prompt_token_ids": [5, 17, 42, 7, 99, 3]}]  # 6 + 20 tokens: past the window of 8 and over 4 blocks
    with_plan, runs = _run(llm, prompt, monkeypatch, plan=True)
    assert runs == [1] * 19  # every decode step after the prefill's token
    without, runs = _run(llm, prompt, monkeypatch, plan=False)
    assert runs == []
    assert with_plan == without
    # Batches of 2 to 5 rows at different positions (some past the window): bit for bit the
    # module path's batch, and each row's tokens those of its lone run. (Its logprobs may differ
    # in the last digits: the LM head ranks more than 4 rows with its int8 copy, fewer with the
    # int4 one, and the tail of the distribution is the ranking's.)
    # A plan takes as many rows as the decoder linears' kernels (4 in bf16 where oneDNN has bf16).
    limit = min(decode_plan.MAX_PLAN_ROWS, linear_max_rows(getattr(torch, dtype)))
    prompts = [*prompt] + [{"prompt_token_ids": list(range(3 + i, 3 + i + 3 * i + 1))} for i in range(4)]
    for n in (2, 5):
        batch, runs = _run(llm, prompts[:n], monkeypatch, plan=True, max_tokens=12)
        assert runs == ([n] * 11 if n <= limit else [])
        assert batch == _run(llm, prompts[:n], monkeypatch, plan=False, max_tokens=12)[0]
        alone = [_run(llm, [p], monkeypatch, plan=False, max_tokens=12)[0][0] for p in prompts[:n]]
        assert [tokens for tokens, _ in batch] == [tokens for tokens, _ in alone]
    _, runs = _run(llm, prompts * 14, monkeypatch, plan=True, max_tokens=3)
    assert runs == []  # 70 rows: more than a plan takes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_chunks_beside_decodes_run_the_plan(gemma3_d32, dtype, monkeypatch):
    """A long prompt in 2-token chunks beside a decoding request (after the chunk's rows in the
    batch): the steps whose chunk has cached context run the plan (its rows as decodes, as the
    module path's attention does), bit for bit the module path, past the window of 8."""
    llm = LLM(gemma3_d32, dtype=dtype, quantization="int8", kv_cache_memory=1 << 24, block_size=8,
              enable_prefix_caching=False, long_prefill_token_threshold=2)
    prompts = [{"prompt_token_ids": list(range(10, 40))}, {"prompt_token_ids": [5, 17, 42]}]
    chunks: list[bool] = []
    with_plan, runs = _run(llm, prompts, monkeypatch, plan=True, chunks=chunks)
    assert sum(chunks) == 14 and 3 in runs  # chunks 2-15 of the long prompt, each beside a decode
    assert with_plan == _run(llm, prompts, monkeypatch, plan=False)[0]


@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "int8"), ("bfloat16", "fp8")])
def test_a_quantized_kv_cache_runs_the_plan_bit_identical(gemma3_d32, dtype, kv_cache_dtype, monkeypatch):
    """The plan writes the byte cache and reads it through the same kernels as the module path:
    alone, beside a prompt in 2-token chunks, past the window of 8."""
    llm = LLM(gemma3_d32, dtype=dtype, quantization="int8", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 24,
              block_size=8, enable_prefix_caching=False, long_prefill_token_threshold=2)
    prompts = [{"prompt_token_ids": [5, 17, 42]}, {"prompt_token_ids": list(range(10, 30))}]
    for batch in (prompts[:1], prompts):
        with_plan, runs = _run(llm, batch, monkeypatch, plan=True, max_tokens=12)
        # alone: the prompt's second chunk (1 token after context) and 11 decodes; together: the
        # long prompt's 2-token chunks beside the decode (3 rows), then both decoding
        assert runs == ([1] * 12 if len(batch) == 1 else [3] * 9 + [2] * 3 + [1] * 8)
        assert with_plan == _run(llm, batch, monkeypatch, plan=False, max_tokens=12)[0]


def test_unquantized_models_keep_the_module_path(gemma3_d32, monkeypatch):
    llm = LLM(gemma3_d32, dtype="float32", kv_cache_memory=1 << 24)
    _, runs = _run(llm, [{"prompt_token_ids": [5, 17, 42]}], monkeypatch, plan=True)
    assert runs == []


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype, quantization", [("float32", "int8"), ("bfloat16", "int4")])
def test_pre_norm_layers_run_the_plan_bit_identical(llama_family_d32, arch, dtype, quantization, monkeypatch):
    llm = LLM(llama_family_d32(arch), dtype=dtype, quantization=quantization, kv_cache_memory=1 << 24,
              block_size=8, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [5, 17, 42, 7, 99, 3]}, {"prompt_token_ids": list(range(20, 31))}]
    for batch in (prompts[:1], prompts):
        with_plan, runs = _run(llm, batch, monkeypatch, plan=True, max_tokens=12)
        assert runs == [len(batch)] * 11
        assert with_plan == _run(llm, batch, monkeypatch, plan=False, max_tokens=12)[0]


def test_a_layer_that_computes_otherwise_keeps_the_module_path(tmp_path, monkeypatch):
    """Granite's layers are Llama's with a residual multiplier: no recipe replays them."""
    path = make_variant(str(tmp_path / "granite"), "granite", head_dim=32)
    llm = LLM(path, dtype="float32", quantization="int8", kv_cache_memory=1 << 24)
    _, runs = _run(llm, [{"prompt_token_ids": [5, 17, 42]}], monkeypatch, plan=True)
    assert runs == []
