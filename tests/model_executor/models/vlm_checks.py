"""What the vision-language model tests share: an engine on a tiny checkpoint, greedy sampling
with logprobs, the comparison with transformers' tokens and logprobs, and the served check."""

from __future__ import annotations

import pytest

MAX_TOKENS = 6


def make_llm(model_dir: str, **kwargs):
    from pagedllm import LLM

    return LLM(model_dir, **{"dtype": "float32", "kv_cache_memory": 1 << 24, "limit_mm_per_prompt": {"image": 2},
                             **kwargs})


def greedy():
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def assert_matches(out, want: tuple[tuple[int, ...], tuple[float, ...]]) -> None:
    """`out` (a RequestOutput) has the reference's tokens and, within 2e-4, its logprobs."""
    completion = out.outputs[0]
    assert tuple(completion.token_ids) == want[0]
    got = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
    assert got == pytest.approx(want[1], abs=2e-4)


def check_served_chat(model_dir: str, tmp_path_factory, content: list[dict], reference) -> None:
    """`pagedllm serve` with the checkpoint's own chat template, through the openai SDK: a chat
    completion on one user message of `content` (image parts as data: URLs) has the tokens and
    logprobs `reference(text)` gives for the processor's rendering of it."""
    import openai

    from pagedllm.multimodal.processing import load_hf_processor
    from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny

    processor = load_hf_processor(model_dir)
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"} if c["type"] != "text" else c for c in content]}], add_generation_prompt=True)
    want_tokens, want_logprobs = reference(text)
    serving = serve_tiny(model_dir, tmp_path_factory, chat_template=None,
                         extra_args=("--limit-mm-per-prompt", '{"image": 2}'))
    url = next(serving)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY)
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                             max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                             extra_body={"ignore_eos": True, "skip_special_tokens": False})
        assert out.choices[0].message.content == processor.tokenizer.decode(want_tokens)
        assert [t.logprob for t in out.choices[0].logprobs.content] == pytest.approx(want_logprobs, abs=2e-4)
    finally:
        serving.close()
