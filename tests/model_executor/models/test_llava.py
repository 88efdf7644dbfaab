"""LLaVA-1.5 against transformers, token for token (float32, tiny random checkpoint with its own
processor): one image, two images, a batch mixing text and image prompts, a chunked prefill that
splits an image, prefix-cache hits and misses on images, chat, preemption and n > 1, tensor and
pipeline parallel, and the server through the openai SDK (chat and Responses)."""

from __future__ import annotations

import functools

import pytest

from tests.utils import data_url, hf_llava_greedy, random_image

MAX_TOKENS = 8
PROMPT = "user: <image>\nwhat is it? assistant:"
# Text long enough that whole blocks (16 tokens) come before the image.
LONG_PROMPT = ("user: The quick brown fox jumps over the lazy dog. Paged attention stores keys and values "
               "in blocks. <image>\nand this? assistant:")


@pytest.fixture(scope="module")
def llava(tiny_llava) -> str:
    return tiny_llava


@functools.cache
def reference(model_dir: str, text: str, seeds: tuple[int, ...], max_tokens: int = MAX_TOKENS) -> tuple[int, ...]:
    return tuple(hf_llava_greedy(model_dir, text, [random_image(s) for s in seeds], max_tokens))


def hf_chat_text(model_dir: str, content: list[dict]) -> str:
    """The reference's rendering of one user message (image parts as {"type": "image"})."""
    from transformers import AutoProcessor

    parts = [{"type": "image"} if c["type"] != "text" else c for c in content]
    return AutoProcessor.from_pretrained(model_dir).apply_chat_template([{"role": "user", "content": parts}],
                                                                        add_generation_prompt=True)


def make_llm(model_dir: str, **kwargs):
    from pagedllm import LLM

    kwargs = {"dtype": "float32", "kv_cache_memory": 1 << 24, "limit_mm_per_prompt": {"image": 2}, **kwargs}
    return LLM(model_dir, **kwargs)


@pytest.fixture(scope="module")
def llm(llava):
    return make_llm(llava)


def greedy(max_tokens: int = MAX_TOKENS):
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def mm(text: str, *seeds: int) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": [random_image(s) for s in seeds]}}


def test_one_image(llm, llava):
    [out] = llm.generate(mm(PROMPT, 0), greedy())
    assert tuple(out.outputs[0].token_ids) == reference(llava, PROMPT, (0,))
    assert len(out.prompt_token_ids) == 40  # 16 placeholder tokens for the one-token <image>


def test_two_images_in_one_prompt(llm, llava):
    text = "user: first <image> then <image>\ncompare. assistant:"
    [out] = llm.generate(mm(text, 1, 2), greedy())
    assert tuple(out.outputs[0].token_ids) == reference(llava, text, (1, 2))
    # The order of the images matters: swapped, another answer from the reference too.
    [swapped] = llm.generate(mm(text, 2, 1), greedy())
    assert tuple(swapped.outputs[0].token_ids) == reference(llava, text, (2, 1))


def test_batch_mixing_text_and_images(llm, llava):
    """Each request's output is its own run's, whatever else is in its batch."""
    text_only = "user: no picture here, just words. assistant:"
    prompts = [mm(PROMPT, 3), text_only, mm(LONG_PROMPT, 4), mm(PROMPT, 3)]
    outs = llm.generate(prompts, greedy())
    assert tuple(outs[0].outputs[0].token_ids) == reference(llava, PROMPT, (3,))
    assert tuple(outs[1].outputs[0].token_ids) == reference(llava, text_only, ())
    assert tuple(outs[2].outputs[0].token_ids) == reference(llava, LONG_PROMPT, (4,))
    assert outs[3].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chunked_prefill_splits_an_image(llava):
    """Chunks of 6 tokens: the image's 16 placeholders span four steps, which read the one encoder
    output from the cache."""
    llm = make_llm(llava, long_prefill_token_threshold=6, enable_prefix_caching=False)
    [out] = llm.generate(mm(LONG_PROMPT, 5), greedy())
    assert tuple(out.outputs[0].token_ids) == reference(llava, LONG_PROMPT, (5,))
    core = llm.llm_engine.engine_core
    assert core.scheduler.encoder_cache_manager.cached  # kept for reuse, unreferenced


def test_prefix_cache_keys_on_the_image(llava):
    """The same text and image hit the cached blocks; the same text with another image hits only
    the blocks before the image, and answers as the reference does for that image."""
    llm = make_llm(llava)
    [first] = llm.generate(mm(LONG_PROMPT, 6), greedy())
    [again] = llm.generate(mm(LONG_PROMPT, 6), greedy())
    [other] = llm.generate(mm(LONG_PROMPT, 7), greedy())
    offset = first.prompt_token_ids.index(llm.get_tokenizer().convert_tokens_to_ids("<image>"))
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (n - 1) // 16 * 16
    assert other.num_cached_tokens == offset // 16 * 16 < again.num_cached_tokens
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert tuple(other.outputs[0].token_ids) == reference(llava, LONG_PROMPT, (7,))


def test_chat_with_image_parts(llm, llava):
    """image_url (a data: URL) and image_pil parts, rendered where the template puts them."""
    content = [
        {"type": "text", "text": "compare"},
        {"type": "image_url", "image_url": {"url": data_url(random_image(8))}},
        {"type": "image_pil", "image_pil": random_image(9)},
    ]
    [out] = llm.chat([{"role": "user", "content": content}], greedy())
    text = hf_chat_text(llava, content)
    assert out.prompt == text
    assert tuple(out.outputs[0].token_ids) == reference(llava, text, (8, 9))


def test_chat_string_template_puts_placeholders_first(llm, llava):
    """A template that takes only string content gets the placeholder before the text."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "what?"},
                                             {"type": "image_pil", "image_pil": random_image(10)}]}]
    template = "{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}bot:"
    [out] = llm.chat(messages, greedy(), chat_template=template)
    assert tuple(out.outputs[0].token_ids) == reference(llava, "user> <image>\nwhat?\nbot:", (10,))


@pytest.mark.parametrize("case, message", [
    ("too_many", "at most 2 are allowed"),
    ("unreadable", "cannot read the image"),
    ("placeholders", "image placeholders"),
    ("not_a_dict", "multi_modal_data must be a dict"),
])
def test_bad_image_inputs_are_value_errors(llm, case, message):
    prompt = {
        "too_many": mm("<image><image><image>", 1, 2, 3),
        "unreadable": {"prompt": PROMPT, "multi_modal_data": {"image": b"not an image"}},
        "placeholders": mm("no placeholder here", 1),
        "not_a_dict": {"prompt": PROMPT, "multi_modal_data": [random_image(1)]},
    }[case]
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, greedy())
    [ok] = llm.generate(mm(PROMPT, 0), greedy())  # the engine goes on
    assert len(ok.outputs[0].token_ids) == MAX_TOKENS


def test_text_model_refuses_images(tiny_llama):
    from pagedllm import LLM

    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="text-only model"):
        llm.generate(mm("hello", 1), greedy())
    with pytest.raises(ValueError, match="takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}], greedy(),
                 chat_template="{{ messages[0]['content'] }}")


def test_speculation_needs_ngram(llava):
    """A draft model would read the image placeholders without the images: refused at start."""
    with pytest.raises(ValueError, match="vision-language model"):
        make_llm(llava, speculative_config={"method": "draft_model", "model": llava, "num_speculative_tokens": 2})


def test_n_greater_than_one_and_preemption(llm, llava):
    """With a KV cache of 7 blocks the requests preempt each other (their images encoded again on
    resuming): greedy answers are still the reference's, and n=2 seeded samples of an image prompt
    are those of a roomy engine."""
    from pagedllm import SamplingParams

    small = make_llm(llava, num_gpu_blocks_override=7, kv_cache_memory=None, max_model_len=112,
                     enable_prefix_caching=False)
    cases = [(PROMPT, 11), (PROMPT, 12), (LONG_PROMPT, 13)]
    outs = small.generate([mm(text, seed) for text, seed in cases], greedy(20))
    for out, (text, seed) in zip(outs, cases):
        assert tuple(out.outputs[0].token_ids) == reference(llava, text, (seed,), 20)
    assert small.get_metrics()["pagedllm:num_preemptions"] > 0
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True, n=2)
    prompts = [mm(PROMPT, 11), mm(LONG_PROMPT, 13)]
    got = [[c.token_ids for c in o.outputs] for o in small.generate(prompts, params)]
    want = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    assert got == want


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                    {"data_parallel_size": 2}], ids=["tp2", "pp2", "dp2"])
def test_parallel_layouts(llava, layout):
    """Two worker processes: the replicated tower on both tensor-parallel ranks (the embedding
    all-reduce needs both), or on the first pipeline stage only; or two engine cores, each with
    its own encoder cache; the reference's tokens either way."""
    llm = make_llm(llava, **layout)
    outs = llm.generate([mm(PROMPT, 16), mm(LONG_PROMPT, 17)], greedy(), use_tqdm=False)
    assert tuple(outs[0].outputs[0].token_ids) == reference(llava, PROMPT, (16,))
    assert tuple(outs[1].outputs[0].token_ids) == reference(llava, LONG_PROMPT, (17,))


def test_served_with_the_openai_sdk(llava, tmp_path_factory):
    """`pagedllm serve` (engine core in its own process, images sent once through the mirrored
    cache): chat completions with data: URLs give the reference's tokens; bad images are 400s."""
    import httpx
    import openai

    from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny

    serving = serve_tiny(llava, tmp_path_factory, chat_template=None,
                         extra_args=("--limit-mm-per-prompt", '{"image": 2}'))
    url = next(serving)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY)
        tok = __import__("transformers").AutoTokenizer.from_pretrained(llava)
        content = [{"type": "text", "text": "compare"},
                   {"type": "image_url", "image_url": {"url": data_url(random_image(14))}},
                   {"type": "image_url", "image_url": {"url": data_url(random_image(15))}}]
        want = tok.decode(reference(llava, hf_chat_text(llava, content), (14, 15)), skip_special_tokens=True)
        for _ in range(2):  # the second time, the core has the images already
            out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 extra_body={"ignore_eos": True})
            assert out.choices[0].message.content == want
        bad = {
            "unreadable": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}],
            "too many": [{"type": "image_url", "image_url": {"url": data_url(random_image(s))}} for s in (1, 2, 3)],
            "file refused": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
            "loopback refused": [{"type": "image_url", "image_url": {"url": f"{url}/health"}}],
        }
        for name, parts in bad.items():
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                               max_tokens=2)
            assert err.value.body["param"] == "messages", name
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                             max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].message.content == want  # nothing was lost
        # /tokenize counts each image as the placeholder tokens it expands to.
        counted = httpx.post(f"{url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                             json={"model": MODEL, "messages": [{"role": "user", "content": content}]}).json()
        assert counted["count"] == out.usage.prompt_tokens == len(tok(hf_chat_text(llava, content)).input_ids) + 30
        # The Responses API's input_image parts.
        parts = [{"type": "input_text", "text": "compare"},
                 {"type": "input_image", "image_url": data_url(random_image(14))},
                 {"type": "input_image", "image_url": data_url(random_image(15))}]
        resp = client.responses.create(model=MODEL, input=[{"role": "user", "content": parts}],
                                       max_output_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert resp.output_text == want
        stored = client.responses.input_items.list(resp.id).data[0]
        assert [c.type for c in stored.content] == ["input_text", "input_image", "input_image"]
    finally:
        serving.close()
