"""Engine outputs → OpenAI response pieces: logprobs in the chat and the legacy
completions formats, vLLM's prompt_logprobs, usage, and per-choice stream deltas."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.logprobs import Logprob
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from pagedllm.outputs import CompletionOutput, RequestOutput

# JSON has no -inf; vLLM reports impossible tokens with this floor too.
_LOGPROB_FLOOR = -9999.0


def _clamp(value: float) -> float:
    return max(value, _LOGPROB_FLOOR)


def _token_text(token_id: int, lp: Logprob | None, tokenizer: Any) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def _top_ranked(entry: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    """The top-n alternatives by rank (the sampled token only if it ranks among them)."""
    ranked = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n]
    return sorted(ranked, key=lambda x: x[1].rank)


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int, tokenizer: Any
) -> ChatCompletionLogProbs:
    content = []
    for tok, entry in zip(token_ids, logprobs):
        chosen = entry.get(tok)
        text = _token_text(tok, chosen, tokenizer)
        tops = [
            TopLogprob(token=(t_text := _token_text(t, lp, tokenizer)), logprob=_clamp(lp.logprob),
                       bytes=list(t_text.encode("utf-8")))
            for t, lp in _top_ranked(entry, top_n)
        ]
        content.append(ChatCompletionLogProbsContent(
            token=text,
            logprob=_clamp(chosen.logprob) if chosen is not None else _LOGPROB_FLOOR,
            bytes=list(text.encode("utf-8")),
            top_logprobs=tops,
        ))
    return ChatCompletionLogProbs(content=content)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens: the named ones and added tokens marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    try:
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        ids.update(i for i, tok in decoder.items() if getattr(tok, "special", False))
    except Exception:  # an unusual tokenizer: the named special tokens only
        pass
    return frozenset(ids)


def completion_logprobs_with_end(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob] | None],
    top_n: int,
    tokenizer: Any,
    initial_offset: int = 0,
    *,
    text: str | None = None,
    special_ids: Collection[int] = (),
) -> tuple[CompletionLogProbs, int]:
    """The legacy format, and the text_offset a token after these would get. `None` entries
    (the first prompt token, which has no logprob) give None as in OpenAI's echo output.
    text_offset is the running length of the token strings: the index into the choice's
    text wherever tokens decode to whole characters. `text` is that text from
    `initial_offset` on: a special token (one of `special_ids`) that it does not show at the
    token's place (a BOS the tokenizer added to a text prompt, an EOS hidden by
    skip_special_tokens) takes no room, so the offsets after it still index into the text."""
    out = CompletionLogProbs()
    offset = initial_offset
    for tok, entry in zip(token_ids, logprobs):
        chosen = entry.get(tok) if entry is not None else None
        token_text = _token_text(tok, chosen, tokenizer)
        out.tokens.append(token_text)
        out.text_offset.append(offset)
        if not (text is not None and tok in special_ids and not text.startswith(token_text, offset - initial_offset)):
            offset += len(token_text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_clamp(chosen.logprob) if chosen is not None else _LOGPROB_FLOOR)
        top = {_token_text(t, lp, tokenizer): _clamp(lp.logprob) for t, lp in _top_ranked(entry, top_n)}
        if chosen is not None:
            top.setdefault(token_text, _clamp(chosen.logprob))
        out.top_logprobs.append(top)
    return out, offset


def prompt_logprobs_json(prompt_logprobs: list[dict[int, Logprob] | None] | None) -> list[dict | None] | None:
    """vLLM's shape: per prompt position, token id → {logprob, rank, decoded_token}."""
    if prompt_logprobs is None:
        return None
    return [
        None if entry is None else {
            str(t): {"logprob": _clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def output_usage(outputs: list[RequestOutput], completion_tokens: int | None = None) -> UsageInfo:
    """Usage summed over prompts and their choices (the prompt counts once per prompt).
    `completion_tokens`: counted by the caller (a stream of DELTA outputs, whose last output
    holds only its own tokens)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = (sum(len(c.token_ids) for o in outputs for c in o.outputs) if completion_tokens is None
                  else completion_tokens)
    cached = sum(o.num_cached_tokens for o in outputs)
    return usage_info(prompt, completion, cached)


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


class DeltaTracker:
    """Each choice of a stream of DELTA outputs (`RequestOutputKind.DELTA`): what an output adds,
    and the text and token count so far (the parsers read the whole text, usage counts tokens).
    A finished choice yields nothing more."""

    def __init__(self) -> None:
        self._text: dict[int, str] = {}
        self._last_len: dict[int, int] = {}  # the length of each choice's last delta text
        self._num_tokens: dict[int, int] = {}
        self._finished: set[int] = set()

    def delta(self, choice: CompletionOutput) -> Delta | None:
        i = choice.index
        if i in self._finished:
            return None
        if not choice.text and not choice.token_ids and choice.finish_reason is None:
            return None
        self._text[i] = self._text.get(i, "") + choice.text
        self._last_len[i] = len(choice.text)
        self._num_tokens[i] = self._num_tokens.get(i, 0) + len(choice.token_ids)
        if choice.finish_reason is not None:
            self._finished.add(i)
        return Delta(choice.text, choice.token_ids, choice.logprobs, choice.finish_reason, choice.stop_reason)

    def texts(self, index: int) -> tuple[str, str]:
        """The choice's text before its last delta and after it: what a stream parser compares."""
        text = self._text.get(index, "")
        return text[: len(text) - self._last_len.get(index, 0)], text

    def num_tokens(self, index: int) -> int:
        return self._num_tokens.get(index, 0)

    def total_tokens(self) -> int:
        return sum(self._num_tokens.values())
