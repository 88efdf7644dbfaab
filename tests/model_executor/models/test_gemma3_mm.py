"""Gemma 3 with images against transformers, token for token and logprob for logprob (float32,
tiny random checkpoint with its own processor). The logprobs are what tells a right mask from a
causal one: an image's soft tokens attend to each other both ways during the prompt, which moves
the logprobs by ~1e-2 on this model while its greedy tokens often stay the same. One image, two
images, a batch mixing text and image prompts, a chunked prefill that would split an image,
prefix-cache hits and misses, and the server through the openai SDK."""

from __future__ import annotations

import functools

import pytest

from tests.model_executor.models.vlm_checks import MAX_TOKENS, assert_matches, check_served_chat, greedy, make_llm
from tests.utils import data_url, hf_vlm_greedy, random_image

PROMPT = "<start_of_turn>user\nlook <start_of_image> what is it?<end_of_turn>\n<start_of_turn>model\n"
# Longer than the sliding window (8) and than a 16-token block before the image.
LONG_PROMPT = ("<start_of_turn>user\nThe quick brown fox jumps over the lazy dog. Paged attention stores keys "
               "and values in blocks. <start_of_image> and this?<end_of_turn>\n<start_of_turn>model\n")
TWO = "<start_of_turn>user\nfirst <start_of_image> then <start_of_image> compare<end_of_turn>\n<start_of_turn>model\n"


@functools.cache
def reference(model_dir: str, text: str, seeds: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    tokens, logprobs = hf_vlm_greedy(model_dir, text, [random_image(s) for s in seeds], MAX_TOKENS)
    return tuple(tokens), tuple(logprobs)


@pytest.fixture(scope="module")
def llm(tiny_gemma3_mm):
    return make_llm(tiny_gemma3_mm)


def mm(text: str, *seeds: int) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": [random_image(s) for s in seeds]}}


def test_one_and_two_images_and_text_in_one_batch(llm, tiny_gemma3_mm):
    prompts = [mm(PROMPT, 0), mm(TWO, 1, 2), "<start_of_turn>user\njust words<end_of_turn>\n", mm(LONG_PROMPT, 3)]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert_matches(outs[0], reference(tiny_gemma3_mm, PROMPT, (0,)))
    assert_matches(outs[1], reference(tiny_gemma3_mm, TWO, (1, 2)))
    assert_matches(outs[2], reference(tiny_gemma3_mm, prompts[2], ()))
    assert_matches(outs[3], reference(tiny_gemma3_mm, LONG_PROMPT, (3,)))
    # <start_of_image> became "\n\n", the marker, 4 soft tokens, the end marker, "\n\n".
    soft = llm.get_tokenizer().convert_tokens_to_ids("<image_soft_token>")
    assert outs[0].prompt_token_ids.count(soft) == 4 and outs[1].prompt_token_ids.count(soft) == 8


def test_chunked_prefill_keeps_an_image_whole(tiny_gemma3_mm):
    """A token budget whose first chunk would end two tokens into the image: the chunk stops
    before it, the next takes all of it (its tokens see each other both ways), with a sliding
    window over the context; the reference's tokens and logprobs."""
    llm0 = make_llm(tiny_gemma3_mm, enable_prefix_caching=False)
    soft = llm0.get_tokenizer().convert_tokens_to_ids("<image_soft_token>")
    [probe] = llm0.generate(mm(LONG_PROMPT, 4), greedy(), use_tqdm=False)
    start = probe.prompt_token_ids.index(soft)
    llm = make_llm(tiny_gemma3_mm, enable_prefix_caching=False, max_num_batched_tokens=start + 2,
                   max_model_len=start + 64)
    scheduler = llm.llm_engine.engine_core.scheduler
    schedule, chunks = scheduler.schedule, []

    def recording():
        out = schedule()
        chunks.extend((r.num_computed_tokens, n) for r in out.scheduled_new_reqs for n in [out.num_scheduled_tokens[
            r.req_id]])
        chunks.extend((c, out.num_scheduled_tokens[i]) for i, c in zip(out.scheduled_cached_reqs.req_ids,
                                                                         out.scheduled_cached_reqs.num_computed_tokens))
        return out

    scheduler.schedule = recording
    [out] = llm.generate(mm(LONG_PROMPT, 4), greedy(), use_tqdm=False)
    assert_matches(out, reference(tiny_gemma3_mm, LONG_PROMPT, (4,)))
    assert chunks[0] == (0, start) and chunks[1][0] == start  # the image waited for the second chunk, whole
    assert all(not (c < start + 4 < c + n) or c >= start for c, n in chunks) and all(
        not (c < start < c + n < start + 4) for c, n in chunks)


def test_prefix_cache_keys_on_the_image(tiny_gemma3_mm):
    llm = make_llm(tiny_gemma3_mm)
    [first] = llm.generate(mm(LONG_PROMPT, 6), greedy(), use_tqdm=False)
    [again] = llm.generate(mm(LONG_PROMPT, 6), greedy(), use_tqdm=False)
    [other] = llm.generate(mm(LONG_PROMPT, 7), greedy(), use_tqdm=False)
    n = len(first.prompt_token_ids)
    start = first.prompt_token_ids.index(llm.get_tokenizer().convert_tokens_to_ids("<image_soft_token>"))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == (n - 1) // 16 * 16
    assert other.num_cached_tokens == start // 16 * 16 < again.num_cached_tokens
    assert_matches(again, reference(tiny_gemma3_mm, LONG_PROMPT, (6,)))
    assert_matches(other, reference(tiny_gemma3_mm, LONG_PROMPT, (7,)))


def test_served_with_the_openai_sdk(tiny_gemma3_mm, tmp_path_factory):
    """`pagedllm serve` with the checkpoint's own chat template: chat completions with data: URLs
    give the reference's tokens and logprobs."""
    content = [{"type": "text", "text": "compare "},
               {"type": "image_url", "image_url": {"url": data_url(random_image(14))}},
               {"type": "image_url", "image_url": {"url": data_url(random_image(15))}}]
    check_served_chat(tiny_gemma3_mm, tmp_path_factory, content, lambda text: reference(tiny_gemma3_mm, text, (14, 15)))
