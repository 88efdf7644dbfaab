"""The OpenAI layer's prompt-length guard: the longest vocabulary entry, measured once per
tokenizer (every serving class asks at start-up) and again when the vocabulary grows."""

from __future__ import annotations

from pagedllm.entrypoints.openai.serving_engine import max_chars_per_token


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
