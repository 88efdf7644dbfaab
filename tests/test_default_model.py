"""The real default model (Gemma 3 270M, Q4_K_M GGUF) against transformers loading the
same GGUF, float32. Slow: minutes on two cores, so only a handful of such tests exist."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.utils import all_slow, assert_greedy_match, cached_reference

pytestmark = pytest.mark.slow

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def default_llm():
    from pagedllm import LLM

    return LLM(dtype="float32", max_model_len=2048, kv_cache_memory=256 << 20, quantization="none")


def test_default_model_greedy_matches_transformers(default_llm):
    """transformers' reference loads the GGUF itself (~90 s here, most of it parsing the GGUF's
    262k-token metadata twice), so it is computed once per GGUF file and library versions and
    kept in the pagedllm cache (tests.utils.cached_reference)."""
    from importlib.metadata import version

    from pagedllm.transformers_utils.default_model import resolve_default_model

    gguf_path = resolve_default_model()
    tok = default_llm.get_tokenizer()
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    assert all(ids[0] == tok.bos_token_id for ids in prompt_ids), "GGUF add_bos_token not honoured"

    def reference() -> list[dict]:
        from transformers import AutoModelForCausalLM

        ref_model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
        ).eval()
        ref = []
        for ids in prompt_ids:
            out = ref_model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
            )
            ref.append({
                "tokens": out.sequences[0, len(ids):].tolist(),
                "logprobs": [torch.log_softmax(s[0].float(), -1) for s in out.logits],
            })
        return ref

    stat = os.stat(gguf_path)
    ref = cached_reference("default-model-greedy", {
        "gguf": [gguf_path, stat.st_size, stat.st_mtime_ns], "prompts": prompt_ids, "max_tokens": MAX_TOKENS,
        "versions": [version("transformers"), version("torch"), version("gguf")],
    }, reference)

    from pagedllm import SamplingParams

    outs = default_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    assert [o.prompt_token_ids for o in outs] == prompt_ids
    assert_greedy_match([o.outputs[0].token_ids for o in outs], ref)
    # The text reads as the reference decodes it.
    assert outs[0].outputs[0].text == tok.decode(ref[0]["tokens"], skip_special_tokens=True)


COPY_PROMPT = ("Copy the following text exactly.\n\nText:\nThe river flows from the mountains in the north to the "
               "sea in the south. Along its banks there are small villages and old mills.\n\nCopy:\nThe river")


@all_slow
def test_default_model_greedy_identical_with_speculation(default_llm, tmp_path):
    """n-gram and a draft model (a 15-layer copy of the target) change nothing in greedy output."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.spec_decode.truncated_draft import make_truncated_draft

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [COPY_PROMPT, PROMPTS[0]]
    reference = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    draft = make_truncated_draft(None, str(tmp_path / "draft"), 15, keep_last=3)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                 {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}):
        llm = LLM(
            dtype="float32", max_model_len=2048, kv_cache_memory=256 << 20, speculative_config=spec, quantization="none"
        )
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
        assert llm.get_metrics()["pagedllm:spec_decode_num_accepted_tokens"] > 0
        del llm


KV_PROMPTS = [f"Question {i}: what is the capital of country number {i}? Answer:" for i in range(10)] + [
    "The history of the Roman empire", "def fibonacci(n):", "Once upon a time", "import numpy as np\n",
    "The quick brown fox", "In mathematics, a prime number", "Water boils at", "The best way to learn",
    "SELECT * FROM", "My favourite recipe is"]
# Greedy tokens of a quantized KV cache may leave the float32 cache's only where its top two are
# this close. For scale: bfloat16 activations and cache flip these prompts at gaps up to 0.33.
KV_TIE_NATS = 0.6


@all_slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_keeps_greedy_tokens_and_perplexity(default_llm, kv_cache_dtype):
    """20 prompts x 48 tokens against the float32 cache (equal, or parting at a near-tie), and the
    perplexity of a fixed text within 1% of the float32 cache's."""
    import pydoc_data.topics

    from pagedllm import LLM, SamplingParams

    text = pydoc_data.topics.topics["assignment"][:3000]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
    nll_params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def nll(llm) -> float:
        out = llm.generate([text], nll_params, use_tqdm=False)[0]
        return -sum(next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]) / (len(out.prompt_logprobs) - 1)

    reference = default_llm.generate(KV_PROMPTS, params, use_tqdm=False)
    reference_nll = nll(default_llm)
    llm = LLM(dtype="float32", max_model_len=2048, kv_cache_memory=256 << 20, quantization="none",
              kv_cache_dtype=kv_cache_dtype)
    outs = llm.generate(KV_PROMPTS, params, use_tqdm=False)
    identical = 0
    for ref, out in zip(reference, outs):
        want, got = list(ref.outputs[0].token_ids), list(out.outputs[0].token_ids)
        if got == want:
            identical += 1
            continue
        pos = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
        top = ref.outputs[0].logprobs[pos]
        assert got[pos] in top and top[want[pos]].logprob - top[got[pos]].logprob < KV_TIE_NATS, (ref.prompt, pos)
    assert identical >= len(KV_PROMPTS) // 2
    assert abs(math.exp(nll(llm) - reference_nll) - 1) < 0.01
    del llm
