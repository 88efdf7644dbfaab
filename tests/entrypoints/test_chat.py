"""`LLM.chat` and chat_utils: Gemma's shipped template, template choice, message validation,
exactly one BOS, and chat == generate on the rendered prompt."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.entrypoints.chat_utils import load_shipped_template, render_conversations, resolve_chat_template

GREEDY = SamplingParams(temperature=0, max_tokens=4)
SIMPLE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Capital of France?"},
]
EXPECTED = (
    "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
    "<start_of_turn>model\nHello!<end_of_turn>\n"
    "<start_of_turn>user\nCapital of France?<end_of_turn>\n"
)


def _gemma_like_tokenizer(add_bos: bool):
    """A small tokenizer with Gemma's special tokens and no chat template; with add_bos it
    prepends <bos> on encode, as Gemma's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["user model Be brief. Hi Hello! Capital of France?"] * 4, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="module")
def gemma_tok():
    return _gemma_like_tokenizer(add_bos=False)


@pytest.fixture(scope="module")
def gemma_tok_bos():
    return _gemma_like_tokenizer(add_bos=True)


@pytest.fixture(scope="module")
def tiny_tok(tiny_gemma3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_gemma3)


def test_gemma_render_exact(gemma_tok):
    assert gemma_tok.chat_template is None  # the fallback is detected from the vocab
    assert render_conversations(gemma_tok, CONV, add_generation_prompt=False) == [EXPECTED]
    assert render_conversations(gemma_tok, CONV) == [EXPECTED + "<start_of_turn>model\n"]


def test_gemma_continue_final_message(gemma_tok):
    conv = CONV + [{"role": "assistant", "content": "The capital is"}]
    (text,) = render_conversations(gemma_tok, conv, add_generation_prompt=False, continue_final_message=True)
    assert text == EXPECTED + "<start_of_turn>model\nThe capital is"


def test_text_parts_are_joined(gemma_tok):
    parts = [{"type": "text", "text": "Capital "}, {"type": "text", "text": "of France?"}]
    conv = CONV[:3] + [{"role": "user", "content": parts}]
    assert render_conversations(gemma_tok, conv, add_generation_prompt=False) == [EXPECTED]
    assert conv[3]["content"] is parts  # the caller's messages are not modified


@pytest.mark.parametrize(
    "messages, kwargs, match",
    [
        ([{"role": "robot", "content": "hi"}], {}, "unknown role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, "takes no images"),
        ([{"role": "user", "content": 5}], {}, "content must be"),
        ([{"role": "user", "content": "hi"}], {"continue_final_message": True}, "cannot both"),
        ([], {}, "non-empty"),
        ([[{"role": "user", "content": "hi"}], {"role": "user", "content": "hi"}], {}, "mixes"),
        ([{"role": "user", "content": "hi"}], {"chat_template_kwargs": {"tokenize": True}}, "may not set"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], {}, "only as the first"),
    ],
)
def test_invalid_input_raises(gemma_tok, messages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        render_conversations(gemma_tok, messages, **kwargs)


def test_exactly_one_bos_when_tokenizer_adds_it(gemma_tok_bos):
    """The template writes <bos> and the tokenizer adds one: the prompt becomes token ids."""
    (prompt,) = render_conversations(gemma_tok_bos, CONV, add_generation_prompt=False)
    ids = prompt["prompt_token_ids"]
    assert prompt["prompt"].startswith("<bos><start_of_turn>user")
    assert ids.count(2) == 1 and ids[0] == 2
    assert gemma_tok_bos.decode(ids) == EXPECTED
    # a template without BOS stays a string: the engine's encode adds the one BOS
    (text,) = render_conversations(gemma_tok_bos, CONV, chat_template=SIMPLE_TEMPLATE)
    assert isinstance(text, str) and gemma_tok_bos(text).input_ids.count(2) == 1


def test_resolve_chat_template_precedence(gemma_tok, tiny_tok, tmp_path):
    gemma = load_shipped_template("gemma")
    assert resolve_chat_template(gemma_tok, None) == gemma
    assert resolve_chat_template(gemma_tok, SIMPLE_TEMPLATE) == SIMPLE_TEMPLATE
    path = tmp_path / "t.jinja"
    path.write_text(SIMPLE_TEMPLATE)
    assert resolve_chat_template(tiny_tok, str(path)) == SIMPLE_TEMPLATE
    with pytest.raises(ValueError, match="neither an existing file"):
        resolve_chat_template(tiny_tok, str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="has no chat template; pass chat_template="):
        resolve_chat_template(tiny_tok, None)  # model_type gemma3, but no Gemma vocab and no template
    try:
        tiny_tok.chat_template = "own: {{ messages[0]['content'] }}"
        assert resolve_chat_template(tiny_tok, None) == tiny_tok.chat_template
        assert resolve_chat_template(tiny_tok, SIMPLE_TEMPLATE) == SIMPLE_TEMPLATE
    finally:
        tiny_tok.chat_template = None


def test_chat_template_kwargs_reach_the_template(tiny_tok):
    template = "{{ greeting }} {{ messages[0]['content'] }}"
    msgs = [{"role": "user", "content": "x"}]
    out = render_conversations(tiny_tok, msgs, chat_template=template, chat_template_kwargs={"greeting": "hey"})
    assert out == ["hey x"]


def test_chat_without_template_raises(llm):
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat([{"role": "user", "content": "Hello"}], GREEDY, use_tqdm=False)


def test_chat_with_explicit_template_equals_generate(llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, my name is"}]
    manual = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
    (got,) = llm.chat(msgs, GREEDY, use_tqdm=False, chat_template=SIMPLE_TEMPLATE)
    (want,) = llm.generate(manual, GREEDY, use_tqdm=False)
    assert got.prompt == manual
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and len(want.outputs[0].token_ids) > 0


def test_chat_tools_reach_the_template(llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    template = "{% for t in tools %}tool: {{ t.function.name }}\n{% endfor %}" + SIMPLE_TEMPLATE
    msgs = [{"role": "user", "content": "Hello"}]
    (out,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, chat_template=template,
                      tools=tools)
    assert out.prompt == "tool: get_weather\nuser: Hello\nassistant:"


def test_chat_batch_in_order(llm):
    convs = [
        [{"role": "user", "content": "The quick brown fox"}],
        [{"role": "user", "content": "Paged attention stores keys"}, {"role": "assistant", "content": "in"}],
    ]
    both = llm.chat(convs, GREEDY, use_tqdm=False, chat_template=SIMPLE_TEMPLATE)
    assert len(both) == 2
    for conv, out in zip(convs, both):
        (alone,) = llm.chat(conv, GREEDY, use_tqdm=False, chat_template=SIMPLE_TEMPLATE)
        assert out.prompt == alone.prompt and out.prompt.startswith(f"user: {conv[0]['content']}")
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.slow
def test_default_model_chat_has_one_bos():
    from pagedllm import LLM

    llm = LLM(max_model_len=1024, kv_cache_memory=128 << 20)  # the file's own blocks: the quickest start
    params = SamplingParams(temperature=0, max_tokens=8)
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)
    tok = llm.get_tokenizer()
    ids = out.prompt_token_ids
    assert tok.bos_token_id == 2 and ids[0] == 2 and ids.count(2) == 1
    assert tok.convert_tokens_to_ids("<start_of_turn>") in ids
    assert tok.decode(ids).endswith("<start_of_turn>model\n")
    assert out.outputs[0].token_ids and out.outputs[0].text.strip()
