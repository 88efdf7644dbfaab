"""Drafts outside an EAGLE-3 head's draft vocabulary: the tokens of the request's own context.

A head with a draft vocabulary (the commonest tokens of its training text) cannot draft any other
token, however plainly the context calls for a copy of one: a name, a number, a rare word of the
prompt. On the default model's held-out chat prompts a tenth of the answer tokens are such copies.
Where the head's LM head rows start from the target's embedding rows of the same tokens (as
`benchmarks/train_eagle.py` makes them), the embedding row of any other token lies in the same
space. So each request keeps the tokens of its context (prompt and output so far) that are
outside the draft vocabulary, with their embedding rows, and a draft is the best of the head's
logits and its normed output's dot products with those rows. Verification is unchanged: a draft is
still one token, accepted or not by the target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_CONTEXT_TOKENS = 1024  # per request: the first distinct ones (2.6 MB of rows at hidden 640)


@dataclass(slots=True)
class _Context:
    scanned: int = 0  # leading tokens of the request's state already looked at
    ids: list[int] = field(default_factory=list)  # tokens outside the draft vocabulary, first seen first
    known: set[int] = field(default_factory=set)
    rows: torch.Tensor | None = None  # [len(ids), hidden] float32 embedding rows


class ContextTokens:
    """Per request, the out-of-vocabulary tokens of its context and their rows; `pick` scores the
    draft rows' normed outputs against them."""

    def __init__(self, draft_ids: Iterable[int], lookup: Callable[[list[int]], torch.Tensor]) -> None:
        """`draft_ids`: the target ids the head's LM head drafts; `lookup`: token ids → the
        target's embedding rows."""
        self.in_draft_vocab = frozenset(draft_ids)
        self.lookup = lookup
        self.requests: dict[str, _Context] = {}

    def update(self, r: Any, new: list[int]) -> None:
        """Take in request `r`'s tokens not yet seen: its state's up to `r.end`, then `new` (the
        step's emitted tokens, in its state from the next step on)."""
        ctx = self.requests.get(r.req_id)
        if ctx is None:
            ctx = self.requests[r.req_id] = _Context()
        fresh = r.state.token_slice(ctx.scanned, r.end) if r.end > ctx.scanned else []
        ctx.scanned = max(ctx.scanned, r.end)
        room = MAX_CONTEXT_TOKENS - len(ctx.ids)
        add = [t for t in dict.fromkeys(fresh + list(new)) if t not in self.in_draft_vocab and t not in ctx.known]
        add = add[:room]
        if not add:
            return
        rows = self.lookup(add).float()
        ctx.ids += add
        ctx.known.update(add)
        ctx.rows = rows if ctx.rows is None else torch.cat((ctx.rows, rows))

    def pick(self, req_ids: list[str], normed: torch.Tensor, best_logits: list[float], ids: list[int],
             conf: list[float] | None) -> None:
        """Where row n's best context token outscores the head's draft (its logit `best_logits[n]`,
        `ids[n]` as a target id), that token becomes `ids[n]`. With `conf` (the head's softmax
        probability of each row's draft), `conf[n]` becomes the draft's probability over the
        head's logits and the context tokens' together: with the head's normalizer Z = e^best /
        conf[n], that is e^l / (Z + sum e^s) for the drafted logit l, taken relative to l."""
        for n, req_id in enumerate(req_ids):
            ctx = self.requests.get(req_id)
            if ctx is None or ctx.rows is None:
                continue
            # Few rows (a handful a request, at most MAX_CONTEXT_TOKENS): one matmul, then Python,
            # cheaper here than more tensor ops, each slow on caches the target's pass has just swept.
            scores = (ctx.rows @ normed[n].float()).tolist()
            top, head = max(scores), best_logits[n]
            if top > head:  # a tie stays with the head's own
                ids[n] = ctx.ids[scores.index(top)]
            if conf is not None:
                drafted = max(top, head)
                conf[n] = 1.0 / (math.exp(head - drafted) / conf[n] + sum(math.exp(s - drafted) for s in scores))

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.requests.pop(req_id, None)


def context_tokens(spec: Any, d2t: list[int], lookup: Callable[[list[int]], torch.Tensor]) -> ContextTokens | None:
    """The EAGLE-3 head's context tokens, where the user's speculative config asks for them, or
    else the head's config.json (`eagle_config.draft_context_tokens`); else None. `lookup`: the
    proposer's embedding rows of token ids."""
    on = spec.draft_context_tokens
    if on is None:
        eagle = getattr(spec.eagle_config, "eagle_config", None)
        on = bool(isinstance(eagle, dict) and eagle.get("draft_context_tokens"))
    if not on:
        return None
    vocab = spec.eagle_config.vocab_size
    if len(d2t) >= vocab:
        raise ValueError(f"draft_context_tokens: the EAGLE-3 head at {spec.heads_path!r} drafts the whole "
                         f"vocabulary ({vocab} tokens), so no context token is outside it")
    return ContextTokens((i + d for i, d in enumerate(d2t)), lookup)
