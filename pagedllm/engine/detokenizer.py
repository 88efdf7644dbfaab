"""Incremental detokenization: text grows token by token, multi-byte safe."""

from __future__ import annotations

from typing import Any

# How many prompt tokens prime the stream, so the first output token gets its
# leading space (SentencePiece) or merges (byte-level BPE) right.
_PRIME_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.output_text = ""
        self._stream = None
        self._ids: list[int] = []
        self._pending: list[int] = []  # tokens the stream holds back (incomplete UTF-8)
        self._recent: list[int] = list(prompt_token_ids[-_PRIME_TOKENS:])  # before the pending ones
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(
                ids=list(prompt_token_ids[-_PRIME_TOKENS:]), skip_special_tokens=skip_special_tokens
            )

    def update(self, token_id: int) -> str:
        """Add one token; returns the newly completed text (may be empty)."""
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 - tokenizers' "Invalid prefix encountered" (see _resync)
                piece = self._resync(token_id)
            if piece is None:
                self._pending.append(token_id)
                piece = ""
            else:
                self._recent = (self._recent + self._pending + [token_id])[-_PRIME_TOKENS:]
                self._pending.clear()
        else:  # slow tokenizers: decode everything and diff
            self._ids.append(token_id)
            text = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
            piece = "" if text.endswith("\ufffd") else text[len(self.output_text):]
        self.output_text += piece
        return piece

    def _resync(self, token_id: int) -> str:
        """The stream refuses a token when the text before it ends in invalid UTF-8 (stray
        byte-fallback tokens, which a sampled model can emit) that the token's bytes change:
        the held-back tokens and this one are decoded as a full decode would (U+FFFD for
        invalid bytes), and a fresh stream goes on from them."""
        from tokenizers.decoders import DecodeStream

        ids = self._recent + self._pending + [token_id]
        before = self.tokenizer.decode(self._recent, skip_special_tokens=self.skip_special_tokens)
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        self._stream = DecodeStream(ids=ids[-_PRIME_TOKENS:], skip_special_tokens=self.skip_special_tokens)
        return text[len(before):]

    def finalize(self) -> str:
        """At the end, bytes still held back are decoded as they are (U+FFFD for
        invalid UTF-8), as a full decode would."""
        if not self._pending:
            return ""
        piece = self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
        self._pending.clear()
        self.output_text += piece
        return piece
