"""IncrementalDetokenizer: text grows token by token as a full decode gives it, also where a
sampled model emits stray byte-fallback tokens (invalid UTF-8) that tokenizers' DecodeStream
refuses to step over."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from pagedllm.engine.detokenizer import IncrementalDetokenizer

WORDS = ["▁a", "▁bc", "d", "▁Some"]


@pytest.fixture(scope="module")
def tokenizer():
    """SentencePiece-style with byte fallback (as Llama 2's and Gemma's): <0xNN> byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({w: 259 + i for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _ids(tokenizer, pieces: list[str]) -> list[int]:
    return tokenizer.convert_tokens_to_ids(pieces)


def _stream(tokenizer, prompt: list[int], out: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.update(t) for t in out]
    pieces.append(detok.finalize())
    assert "".join(pieces) == detok.output_text
    return detok.output_text


def test_a_stray_lead_byte_before_a_word_does_not_raise(tokenizer):
    prompt = _ids(tokenizer, ["▁a", "▁bc"])
    out = _ids(tokenizer, ["<0x06>", "<0xD1>", "▁Some", "▁a", "d"])
    raw = DecodeStream(ids=prompt, skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):  # what the stream alone does with it
        for t in out:
            raw.step(tokenizer._tokenizer, t)
    assert _stream(tokenizer, prompt, out) == "\x06\ufffd Some ad"


def test_multibyte_characters_and_words_as_a_full_decode(tokenizer):
    prompt = _ids(tokenizer, ["▁a"])
    euro = [f"<0x{b:02X}>" for b in "€".encode()]
    out = _ids(tokenizer, ["▁bc", *euro, "d", "▁Some", *euro[:2]])  # ends in an incomplete character
    full = tokenizer.decode(prompt + out)
    assert _stream(tokenizer, prompt, out) == full[len(tokenizer.decode(prompt)):]
