"""What real clients do against `pagedllm serve`, each with the client itself: the openai SDK's
models.retrieve, echo with max_tokens 0 (prompt scoring), text_offset under an added BOS, the
developer role; and lm-eval's `local-completions` model with its remote tokenizer
(/tokenizer_info, /tokenize, /detokenize) computing loglikelihoods, checked against
transformers. The model is the tiny llama with a tokenizer that adds a BOS, as Llama's does."""

from __future__ import annotations

import os
import shutil

import httpx
import openai
import pytest
import torch

from tests.entrypoints.openai.conftest import CHAT_TEMPLATE
from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BOS, EOS = 1, 2
PROMPT = "The quick brown fox"
# Generation is limited to these words' tokens: whole ASCII characters, so every text_offset
# can be checked against the text.
ASCII_WORDS = "The quick brown fox jumps over the lazy dog. Hello, my name is Ada"


@pytest.fixture(scope="module")
def bos_model(tiny_llama, tmp_path_factory) -> str:
    """tiny_llama whose tokenizer puts <s> before every text it encodes with special tokens."""
    from tokenizers import Tokenizer, processors

    path = str(tmp_path_factory.mktemp("llama_bos") / "model")
    shutil.copytree(tiny_llama, path)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS)])
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def server(bos_model, tmp_path_factory):
    yield from serve_tiny(bos_model, tmp_path_factory,
                          extra_args=("--served-model-name", MODEL, "org/tiny",
                                      "--enable-tokenizer-info-endpoint"))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tok(bos_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bos_model)


@pytest.fixture(scope="module")
def hf_logprobs(bos_model):
    """ids → the logprob of each token after the first given those before it, by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bos_model, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, -1)[:-1]  # row i: the distribution of token i + 1

    return run


def _token_logprobs(rows: torch.Tensor, ids: list[int]) -> list[float]:
    return [float(rows[i - 1, t]) for i, t in enumerate(ids) if i > 0]


# ---- models.retrieve --------------------------------------------------------------------------


def test_models_retrieve(client):
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {MODEL, "org/tiny"}
    for name in listed:  # a served name with a slash too
        card = client.models.retrieve(name)
        assert (card.id, card.object, card.owned_by) == (name, "model", "pagedllm")
        assert card.model_extra["max_model_len"] == 256 == listed[name].model_extra["max_model_len"]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["type"] == "not_found_error" and "gpt-4" in e.value.body["message"]


# ---- echo with max_tokens 0 -------------------------------------------------------------------


def test_echo_without_generation_scores_the_prompt(client, tok, hf_logprobs):
    ids = tok(PROMPT).input_ids
    assert ids[0] == BOS
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    (c,) = r.choices
    assert c.text == PROMPT and c.finish_reason == "length"
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.tokens[0] == "<s>"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no logprob
    assert lp.token_logprobs[1:] == pytest.approx(_token_logprobs(hf_logprobs(ids), ids), abs=1e-3)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])  # top-1 and the prompt's token
    assert lp.text_offset[:2] == [0, 0]  # the added BOS is not in the text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    (one,) = [ch.choices[0] for ch in chunks if ch.choices]
    assert (one.text, one.finish_reason) == (PROMPT, "length")
    assert one.logprobs.token_logprobs == lp.token_logprobs and one.logprobs.text_offset == lp.text_offset
    assert chunks[-1].usage.completion_tokens == 0


def test_echo_without_generation_of_token_id_prompts(client, tok, hf_logprobs):
    """lm-eval's shape of request: a batch of token-id prompts, logprobs=1, greedy."""
    batch = [tok("Hello, my name is Ada", add_special_tokens=False).input_ids,
             tok(" jumps over the lazy dog", add_special_tokens=False).input_ids]
    r = client.completions.create(model=MODEL, prompt=batch, echo=True, max_tokens=0, logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for ids, c in zip(batch, r.choices):
        assert c.text == tok.decode(ids) and len(c.logprobs.token_logprobs) == len(ids)
        assert c.logprobs.token_logprobs[1:] == pytest.approx(_token_logprobs(hf_logprobs(ids), ids), abs=1e-3)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == sum(map(len, batch))


def test_max_tokens_zero_needs_echo(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1, echo=True)


# ---- text_offset with echo --------------------------------------------------------------------


def _check_offsets(text: str, tokens: list[str], offsets: list[int], special: set[str]) -> None:
    """Each token's string is at its offset in the text; a special token the text does not
    show takes no room (the next token has its offset)."""
    assert offsets == sorted(offsets)
    for i, (token, offset) in enumerate(zip(tokens, offsets)):
        if token in special and not text.startswith(token, offset):
            assert i + 1 == len(offsets) or offsets[i + 1] == offset, (i, token, offsets)
        else:
            assert text[offset:offset + len(token)] == token, (i, token, offset, text)


@pytest.mark.parametrize("prompt_kind", ["text", "token ids"])
def test_echo_text_offsets_index_into_the_returned_text(client, tok, prompt_kind):
    allowed = sorted(set(tok(ASCII_WORDS, add_special_tokens=False).input_ids))
    prompt = PROMPT if prompt_kind == "text" else tok(PROMPT).input_ids  # token ids: <s> is decoded into the text
    kw = dict(model=MODEL, prompt=prompt, echo=True, max_tokens=6, logprobs=1, temperature=0,
              extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    c = client.completions.create(**kw).choices[0]
    lp = c.logprobs
    n_prompt = len(tok(PROMPT).input_ids)
    assert len(lp.tokens) == n_prompt + 6
    assert c.text.startswith(PROMPT if prompt_kind == "text" else "<s>" + PROMPT)
    if prompt_kind == "text":
        assert lp.tokens[0] == "<s>" and lp.text_offset[:2] == [0, 0]
    else:
        assert lp.text_offset[:2] == [0, 3]
    _check_offsets(c.text, lp.tokens, lp.text_offset, {"<s>", "</s>", "<pad>"})

    streamed = [ch.choices[0] for ch in client.completions.create(stream=True, **kw)]
    assert "".join(ch.text for ch in streamed) == c.text
    assert [o for ch in streamed for o in ch.logprobs.text_offset] == lp.text_offset
    assert [t for ch in streamed for t in ch.logprobs.tokens] == lp.tokens


# ---- the developer role -----------------------------------------------------------------------


def test_developer_role_is_the_system_role(client, server):
    user = {"role": "user", "content": "Hello, my name is"}
    kw = dict(model=MODEL, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    dev = client.chat.completions.create(messages=[{"role": "developer", "content": "Be brief."}, user], **kw)
    sys_ = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."}, user], **kw)
    assert dev.choices[0].message.content == sys_.choices[0].message.content
    rendered = httpx.post(f"{server}/tokenize", headers=AUTH, json={
        "messages": [{"role": "system", "content": "Be brief."}, user]}).json()["count"]
    assert dev.usage.prompt_tokens == sys_.usage.prompt_tokens == rendered


# ---- /tokenizer_info and lm-eval ---------------------------------------------------------------


def test_tokenizer_info(server, bos_model, tmp_path_factory):
    r = httpx.get(f"{server}/tokenizer_info", headers=AUTH)
    assert r.status_code == 200, r.text
    info = r.json()
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert info["model_max_length"] == 256 and info["tokenizer_class"] and info["chat_template"] == CHAT_TEMPLATE
    for path in (bos_model, os.path.realpath(bos_model), str(tmp_path_factory.getbasetemp())):
        assert path not in r.text  # no server path reaches a client
    assert httpx.get(f"{server}/tokenizer_info").status_code == 401


def test_lm_eval_remote_tokenizer(server, tok):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    url = f"{server}/v1/completions"
    assert check_remote_tokenizer_support(url, auth_token=API_KEY)
    remote = RemoteTokenizer(url, auth_token=API_KEY)
    assert (remote.bos_token_id, remote.eos_token_id) == (BOS, EOS)
    assert remote.encode(PROMPT) == tok(PROMPT, add_special_tokens=False).input_ids
    assert remote.decode(remote.encode(PROMPT)) == PROMPT
    assert remote.apply_chat_template([{"role": "user", "content": "Hi"}]) == "user: Hi\nassistant:"


def test_lm_eval_local_completions_loglikelihood(server, tok, hf_logprobs, monkeypatch):
    """lm-eval's `local-completions` model (tokenized requests, batched, remote tokenizer)
    scores (context, continuation) pairs and whole texts the way its tasks do."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # its completion requests' bearer token
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    lm = LocalCompletionsAPI(base_url=f"{server}/v1/completions", model=MODEL, tokenizer_backend="remote",
                             auth_token=API_KEY, batch_size=2, max_length=256, max_retries=1)
    pairs = [("The quick brown", " fox jumps"), ("Hello, my name is", " Ada"), ("", "Paged attention")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    assert len(got) == len(pairs)

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        if context:  # lm-eval's split: the whole text's tokens after the context's
            context_ids = encode(context)
            continuation_ids = encode(context + continuation)[len(context_ids):]
        else:  # an empty context is the BOS, which lm-eval learns from /tokenizer_info
            context_ids, continuation_ids = [BOS], encode(continuation)
        ids = context_ids + continuation_ids
        rows = hf_logprobs(ids)
        scored = range(len(context_ids) - 1, len(ids) - 1)
        assert logprob == pytest.approx(sum(float(rows[i, ids[i + 1]]) for i in scored), abs=2e-3)
        assert greedy == all(int(rows[i].argmax()) == ids[i + 1] for i in scored)

    text = "Paged attention stores keys and values in fixed-size blocks."
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    ids = [BOS, *encode(text)]
    assert rolling == pytest.approx(sum(_token_logprobs(hf_logprobs(ids), ids)), abs=5e-3)
