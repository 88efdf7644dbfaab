"""`--quantization`: the CLI flag, and the quantized engine against the float one (the flag's checks:
tests/test_config.py)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import DynamicInt8Quant, QuantizedLMHead, WeightOnlyQuant

PROMPTS = ["The quick brown fox", "Paged attention stores keys", "Hello, my name is"]


def _model(llm):
    return llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model


def _kernels_for_all_rows(llm) -> None:
    """Prefill and prompt logprobs run many rows; send them through the kernels too."""
    for m in _model(llm).modules():
        if isinstance(m, WeightOnlyQuant):
            m.max_rows = 1 << 30


def _prompt_logprobs(llm, prompts: list[str]) -> list[list[float]]:
    from pagedllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(prompt_logprobs=0, max_tokens=1), use_tqdm=False)
    return [[d[t].logprob for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])] for o in outs]


def test_cli_flag_reaches_engine_args():
    from pagedllm.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from_namespace(parser.parse_args([])).quantization is None
    assert engine_args_from_namespace(parser.parse_args(["--quantization", "int4"])).quantization == "int4"
    assert engine_args_from_namespace(parser.parse_args(["--quantization", "none"])).quantization == "none"
    assert engine_args_from_namespace(parser.parse_args(["-q", "fp8"])).quantization == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp4"])


@pytest.fixture(scope="module", params=["int8", "int4"])
def quant_llm(request, tiny_gemma3):
    from pagedllm import LLM

    return LLM(tiny_gemma3, dtype="float32", kv_cache_memory=1 << 24, quantization=request.param)


def test_quantized_engine_is_close_to_the_float_one(quant_llm, llm):
    from pagedllm import SamplingParams

    model = _model(quant_llm)
    linears = [m.quant for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 3 * 4 and all(isinstance(m, WeightOnlyQuant) and m.method == "int8" for m in linears)
    head = model.lm_head.quant
    assert isinstance(head, QuantizedLMHead) and isinstance(head.dynamic, DynamicInt8Quant)
    if quant_llm.llm_engine.config.model_config.quantization == "int4":
        assert head.few_rows.method == "int4" and head.top_k > 0
    else:
        assert head.few_rows is None and head.top_k == 0
    # The tied head's embedding is the float model's, untouched.
    torch.testing.assert_close(model.model.embed_tokens.weight, _model(llm).model.embed_tokens.weight, rtol=0, atol=0)

    _kernels_for_all_rows(quant_llm)
    for got, want in zip(_prompt_logprobs(quant_llm, PROMPTS), _prompt_logprobs(llm, PROMPTS)):
        assert len(got) == len(want)
        diffs = [abs(a - b) for a, b in zip(got, want)]
        assert max(diffs) < 0.2 and sum(diffs) / len(diffs) < 0.05
    # Greedy decode (one row per step: the kernels) gives the same text as the float engine.
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in quant_llm.generate(PROMPTS, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want


def test_bf16_quantized_engine_generates(tiny_gemma3):
    from pagedllm import LLM, SamplingParams

    llm = LLM(tiny_gemma3, dtype="bfloat16", kv_cache_memory=1 << 24, quantization="int4")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert all(math.isfinite(v) for lps in _prompt_logprobs(llm, PROMPTS) for v in lps)


@pytest.mark.parametrize("isa, native_bf16, dtype, rows", [
    ("avx2", False, torch.float32, 128),  # the AVX2 build against the float32 GEMM
    ("avx2", False, torch.bfloat16, 128),  # bf16 weights without native bf16: no fast GEMM either
    ("avx512", False, torch.float32, 32),
    ("generic", False, torch.float32, 32),
    (None, False, torch.float32, 32),  # no C kernels: torch's int8 matmul
    ("avx512", True, torch.bfloat16, 4),  # against oneDNN's bf16 GEMM
    ("avx512", True, torch.float32, 32),
])
def test_decoder_int8_row_limit_follows_the_kernels_build(monkeypatch, isa, native_bf16, dtype, rows):
    from pagedllm.model_executor.loader import quantize

    lib = None if isa is None else argparse.Namespace(pl_isa=isa)
    monkeypatch.setattr(quantize.cpu_kernels, "kernels", lambda: lib)
    monkeypatch.setattr(quantize, "onednn_has_bf16", lambda: native_bf16)
    assert quantize.linear_max_rows(dtype) == rows
