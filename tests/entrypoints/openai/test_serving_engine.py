"""The OpenAI layer's start-up measures: the prompt-length guard (the longest vocabulary entry,
measured once per tokenizer, as every serving class asks, and again when the vocabulary grows)
and the vocabulary size prompt token ids are checked against."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.entrypoints.openai.serving_engine import max_chars_per_token, vocab_size


class _Vocab:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.scans = tokens, 0

    def __len__(self) -> int:
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        self.scans += 1
        return [self.tokens[i] for i in ids]


def test_measured_once_then_again_after_tokens_are_added():
    tok = _Vocab(["a", "abc", "ab"])
    assert max_chars_per_token(tok) == 3 and max_chars_per_token(tok) == 3 and tok.scans == 1
    tok.tokens.append("<|a_much_longer_added_token|>")
    assert max_chars_per_token(tok) == len("<|a_much_longer_added_token|>") and tok.scans == 2


def test_a_tokenizer_that_cannot_list_its_vocabulary_gets_a_generous_bound():
    class Opaque:
        def __len__(self) -> int:
            raise TypeError("no length")

    assert max_chars_per_token(Opaque()) == 64


def test_vocab_size_from_the_model_then_the_tokenizer():
    class Sized:
        vocab_size = 7

    class Opaque:
        def __len__(self) -> int:
            raise TypeError("no length")

    model = SimpleNamespace(text_config=SimpleNamespace(vocab_size=262144))
    assert vocab_size(model, _Vocab(["a"])) == 262144  # the model's, whatever the tokenizer says
    assert vocab_size(SimpleNamespace(), _Vocab(["a", "b", "c"])) == 3  # added tokens count
    with_added = _Vocab(["a", "b", "c", "<added>", "<added2>"])
    with_added.vocab_size = 3  # the base vocabulary, without the added tokens
    assert vocab_size(SimpleNamespace(), with_added) == 5
    assert vocab_size(SimpleNamespace(text_config=SimpleNamespace(vocab_size=None)), Sized()) == 7
    opaque_sized = type("OpaqueSized", (Opaque,), {"vocab_size": 5})()
    assert vocab_size(SimpleNamespace(), opaque_sized) == 5
    with pytest.raises(ValueError, match="vocabulary size"):
        vocab_size(SimpleNamespace(), Opaque())
