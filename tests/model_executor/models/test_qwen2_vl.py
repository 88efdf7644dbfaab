"""Qwen2-VL and Qwen2.5-VL against transformers, token for token and logprob for logprob
(float32, tiny random checkpoints with their own processor). Images of different sizes take
different numbers of tokens (native resolution); image tokens take three-part M-RoPE positions
and every token after an image is shifted. One image, two images of two sizes, a batch mixing
text and image prompts, a chunked prefill that splits an image, prefix-cache hits and misses, and
the server through the openai SDK (for Qwen2.5-VL: the versions differ only inside the vision
tower, which the offline checks cover for both)."""

from __future__ import annotations

import functools

import pytest

from tests.model_executor.models.vlm_checks import MAX_TOKENS, assert_matches, check_served_chat, greedy, make_llm
from tests.utils import data_url, hf_vlm_greedy, make_tiny_qwen2_vl, random_image

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\nlook {IMAGE} what is it?<|im_end|>\n<|im_start|>assistant\n"
LONG_PROMPT = (f"<|im_start|>user\nThe quick brown fox jumps over the lazy dog. Paged attention stores keys and "
               f"values in blocks. {IMAGE} and this?<|im_end|>\n<|im_start|>assistant\n")
TWO = f"<|im_start|>user\nfirst {IMAGE} then {IMAGE} compare<|im_end|>\n<|im_start|>assistant\n"
# (seed, width, height): the second is larger, so it takes more tokens (6 and 12: the processor
# caps an image at 32 x 32 px, in 8-px steps).
SMALL, LARGE = (1, 24, 16), (2, 64, 96)


def image(spec):
    return random_image(*spec)


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["qwen2_vl", "qwen2_5_vl"])
def model_dir(request, tmp_path_factory) -> str:
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp(f"qwen{request.param}_vl")), request.param)


@functools.cache
def reference(model_dir: str, text: str, specs: tuple) -> tuple[tuple[int, ...], tuple[float, ...]]:
    tokens, logprobs = hf_vlm_greedy(model_dir, text, [image(s) for s in specs], MAX_TOKENS)
    return tuple(tokens), tuple(logprobs)


def mm(text: str, *specs) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": [image(s) for s in specs]}}


def test_images_of_two_sizes_and_text_in_one_batch(model_dir):
    llm = make_llm(model_dir)
    prompts = [mm(PROMPT, SMALL), mm(TWO, SMALL, LARGE), "<|im_start|>user\njust words<|im_end|>\n",
               mm(LONG_PROMPT, LARGE)]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert_matches(outs[0], reference(model_dir, PROMPT, (SMALL,)))
    assert_matches(outs[1], reference(model_dir, TWO, (SMALL, LARGE)))
    assert_matches(outs[2], reference(model_dir, prompts[2], ()))
    assert_matches(outs[3], reference(model_dir, LONG_PROMPT, (LARGE,)))
    pad = llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    small, both = outs[0].prompt_token_ids.count(pad), outs[1].prompt_token_ids.count(pad)
    assert (small, both) == (6, 6 + 12)  # the larger image takes more tokens


def test_chunked_prefill_splits_an_image(model_dir):
    """Chunks of 5 tokens: the image's positions are read chunk by chunk, its embeddings from the
    encoder cache."""
    llm = make_llm(model_dir, long_prefill_token_threshold=5, enable_prefix_caching=False)
    [out] = llm.generate(mm(LONG_PROMPT, LARGE), greedy(), use_tqdm=False)
    assert_matches(out, reference(model_dir, LONG_PROMPT, (LARGE,)))


def test_prefix_cache_keys_on_the_image(model_dir):
    llm = make_llm(model_dir)
    [first] = llm.generate(mm(LONG_PROMPT, SMALL), greedy(), use_tqdm=False)
    [again] = llm.generate(mm(LONG_PROMPT, SMALL), greedy(), use_tqdm=False)
    [other] = llm.generate(mm(LONG_PROMPT, (3, 24, 16)), greedy(), use_tqdm=False)
    n = len(first.prompt_token_ids)
    start = first.prompt_token_ids.index(llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>"))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == (n - 1) // 16 * 16
    assert other.num_cached_tokens == start // 16 * 16 < again.num_cached_tokens
    assert_matches(again, reference(model_dir, LONG_PROMPT, (SMALL,)))
    assert_matches(other, reference(model_dir, LONG_PROMPT, ((3, 24, 16),)))


@pytest.mark.parametrize("model_dir", ["2.5"], ids=["qwen2_5_vl"], indirect=True)
def test_served_with_the_openai_sdk(model_dir, tmp_path_factory):
    """`pagedllm serve` with the checkpoint's own chat template: two images of two sizes as data:
    URLs give the reference's tokens and logprobs."""
    content = [{"type": "text", "text": "compare "},
               {"type": "image_url", "image_url": {"url": data_url(image(SMALL))}},
               {"type": "image_url", "image_url": {"url": data_url(image(LARGE))}}]
    check_served_chat(model_dir, tmp_path_factory, content, lambda text: reference(model_dir, text, (SMALL, LARGE)))
