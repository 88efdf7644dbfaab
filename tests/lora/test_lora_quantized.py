"""LoRA on the default model's quantized linears (its GGUF blocks, and int4 copies): a zero
adapter leaves every token as the base model's, random adapters change them, and in a batch that
mixes four adapters with the base model each request gets the tokens it gets in a batch of the
same size with no other adapter (same size: the same GEMM paths). Slow: the real default model."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli.bench_lora import write_random_adapter
from pagedllm.lora_request import LoRARequest
from tests.utils import all_slow

pytestmark = [pytest.mark.slow, all_slow]

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("quantization", ["gguf", "int4"])
def test_lora_on_the_quantized_default_model(tmp_path, quantization):
    llm = LLM(max_model_len=512, kv_cache_memory=64 << 20, quantization=quantization, enable_lora=True, max_loras=4,
              max_cpu_loras=5)
    text_config = llm.llm_engine.config.model_config.text_config
    assert llm.llm_engine.config.model_config.quantization == quantization
    zero = LoRARequest("zero", 1, write_random_adapter(str(tmp_path / "zero"), text_config, 16, 0, scale=0.0))
    loras = [LoRARequest(f"a{i}", i + 2, write_random_adapter(str(tmp_path / f"a{i}"), text_config, 16, i,
                                                              scale=0.05)) for i in range(4)]

    def run(lora_per_prompt):
        outs = llm.generate(PROMPTS * 5, PARAMS, use_tqdm=False, lora_request=lora_per_prompt)
        return [o.outputs[0].token_ids for o in outs]

    base = run([None] * 20)
    assert run([zero] * 20) == base
    mix = [None, *loras] * 4  # prompt i % 4 under adapter i % 5
    mixed = run(mix)
    for lora in loras:
        alone = run([lora] * 20)
        rows = [i for i, m in enumerate(mix) if m is lora]
        assert [mixed[i] for i in rows] == [alone[i] for i in rows]
        assert any(alone[i] != base[i] for i in rows)
    assert [mixed[i] for i, m in enumerate(mix) if m is None] == [base[i] for i, m in enumerate(mix) if m is None]
