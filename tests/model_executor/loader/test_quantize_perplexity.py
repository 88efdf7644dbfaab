"""Perplexity of the default model (Gemma 3 270M, Q4_K_M GGUF) on a fixed English text, bf16
against --quantization int8 / int4 / gguf: each must stay within 2% of bf16. Slow: loads the real model
five times (~50 s on two cores)."""

from __future__ import annotations

import math

import pytest

from tests.model_executor.loader.test_quantize import _kernels_for_all_rows, _prompt_logprobs
from tests.utils import all_slow

pytestmark = [pytest.mark.slow, all_slow]

TEXT = (
    'The lighthouse on the northern cape was built in 1856, after a winter in which three ships were lost'
    ' on the rocks below the cliffs. Its first keeper, a retired sailor named Thomas Hale, kept a journal'
    ' for almost thirty years. He wrote down the weather every morning, the ships that passed, and the '
    'small events of a quiet life: the day the supply boat arrived late, the summer his daughter learned '
    'to swim, the storm that broke every window in the lantern room. Historians value the journal because'
    ' it records how the light itself changed. At first it burned whale oil, which was expensive and '
    'smoked badly, so the glass had to be cleaned twice a night. Later the keepers switched to kerosene, '
    'which was brighter and cheaper, and in 1921 the station was connected to electricity. Each change '
    'made the work easier, but it also meant that fewer people were needed. By the middle of the century '
    'the light was automatic, and the last keeper left the cape in 1957. Today the tower is a small '
    'museum. Visitors climb the narrow iron stairs, look out over the grey water, and read copies of the '
    'journal pages in glass cases. Many of them say that the most moving entry is a short one from March '
    '1871, written after a long night of fog: "No ships tonight. The horn sounded until dawn. I do not '
    'know if anyone heard it, but we kept it going all the same." The museum also keeps a collection of '
    'tools, maps and letters. Some letters came from sailors who wanted to thank the keepers, and others '
    'came from families asking for news of a missing boat. Reading them, one understands that a '
    'lighthouse was never only a machine. It was a promise that someone was watching, and that the coast,'
    ' however dangerous, could be passed safely.'
)


def _perplexity(quantization: str, few_rows_kernels: bool = True) -> float:
    from pagedllm import LLM

    llm = LLM(quantization=quantization, max_model_len=1024, kv_cache_memory=64 << 20)
    if quantization != "none" and few_rows_kernels:
        _kernels_for_all_rows(llm)  # score the text the way batch-1 decode computes it
    (logprobs,) = _prompt_logprobs(llm, [TEXT])
    assert len(logprobs) > 300
    return math.exp(-sum(logprobs) / len(logprobs))


def test_quantized_perplexity_within_two_percent_of_bf16():
    base = _perplexity("none")
    assert 10 < base < 40  # a sane model on plain English
    # int4 twice: its few-rows kernels (batch-1 decode), then the many-rows path (big batches);
    # gguf: the file's own blocks, the default.
    for method, few_rows in (("int8", True), ("int4", True), ("int4", False), ("gguf", False)):
        ppl = _perplexity(method, few_rows)
        print(f"perplexity bf16 {base:.3f}, {method} (few-rows kernels: {few_rows}) {ppl:.3f} ({ppl / base - 1:+.2%})")
        assert abs(ppl / base - 1) < 0.02, f"{method}: perplexity {ppl:.3f} vs bf16 {base:.3f}"
