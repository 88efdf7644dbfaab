"""`pagedllm serve` with a distributed layout, driven by the openai SDK: -dp 2 spreads concurrent
requests over two engine cores (each labelled in /metrics), and -pp 2 serves through two pipeline
stages, each with its layers' int8 KV cache (--kv-cache-dtype, in vLLM's cache_config_info); both
answer as one rank does (the offline engine, in this process, gives the reference)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams
from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny

PROMPTS = ["Hello, my name is", "The sky is", "One two three", "Paris is"]


async def _complete_all(url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    outs = await asyncio.gather(*[client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                                            extra_body={"ignore_eos": True}) for p in PROMPTS])
    return [o.choices[0].text for o in outs]


def _reference(model: str, kv_cache_dtype: str) -> list[str]:
    """What one rank answers: the served flags' dtype and length, greedy, the same 8 tokens."""
    llm = LLM(model, dtype="float32", kv_cache_memory=16 << 20, max_model_len=256, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("layout", [("--data-parallel-size", "2"),
                                    ("--pipeline-parallel-size", "2", "--kv-cache-dtype", "int8")])
def test_served_layout_answers_as_one_rank(tiny_llama, tmp_path_factory, layout):
    kv_cache_dtype = layout[layout.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in layout else "auto"
    reference = _reference(tiny_llama, kv_cache_dtype)
    serving = serve_tiny(tiny_llama, tmp_path_factory, extra_args=layout)
    url = next(serving)
    try:
        assert asyncio.run(_complete_all(url)) == reference
        metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        assert f'cache_dtype="{kv_cache_dtype}"' in metrics
        if layout[0] == "--data-parallel-size":
            for engine in ("0", "1"):
                line = next(ln for ln in metrics.splitlines()
                            if ln.startswith(f'pagedllm:prefix_cache_queries_total{{engine="{engine}"'))
                assert float(line.rsplit(" ", 1)[1]) > 0  # both cores served requests
    finally:
        next(serving, None)
