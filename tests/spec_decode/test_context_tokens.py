"""The context tokens an EAGLE-3 head may draft outside its draft vocabulary
(spec_decode/context_tokens.py): which tokens each request keeps, how a draft is picked, and the
draft's probability over both kinds of logits. (test_eagle3.py runs them in the engine against a
reference of the head.)"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from pagedllm.spec_decode import context_tokens
from pagedllm.spec_decode.context_tokens import ContextTokens

EMBEDDING = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))


def _request(req_id: str, tokens: list[int], end: int) -> SimpleNamespace:
    state = SimpleNamespace(token_slice=lambda start, stop: tokens[start:stop])
    return SimpleNamespace(req_id=req_id, state=state, end=end)


def _context(lookups: list[list[int]] | None = None) -> ContextTokens:
    def lookup(ids: list[int]) -> torch.Tensor:
        if lookups is not None:
            lookups.append(ids)
        return EMBEDDING[ids]

    return ContextTokens(range(0, 50, 2), lookup)  # the even ids are the draft vocabulary


def test_each_request_keeps_its_other_tokens_once_in_first_seen_order(monkeypatch):
    lookups: list[list[int]] = []
    ctx = _context(lookups)
    tokens = [4, 7, 9, 7, 2, 11, 13, 9]
    ctx.update(_request("a", tokens, 5), [15, 7])  # known: tokens[:5], then the step's 15 and 7
    assert ctx.requests["a"].ids == [7, 9, 15] and lookups == [[7, 9, 15]]
    ctx.update(_request("a", tokens, 8), [17])  # only tokens[5:8] and 17 are new to it
    assert ctx.requests["a"].ids == [7, 9, 15, 11, 13, 17] and lookups[-1] == [11, 13, 17]
    assert torch.equal(ctx.requests["a"].rows, EMBEDDING[[7, 9, 15, 11, 13, 17]])
    ctx.update(_request("a", tokens, 8), [9])
    assert len(lookups) == 2  # nothing new: no lookup
    monkeypatch.setattr(context_tokens, "MAX_CONTEXT_TOKENS", 7)
    ctx.update(_request("a", tokens + [19, 21, 23], 11), [])
    assert ctx.requests["a"].ids == [7, 9, 15, 11, 13, 17, 19]  # up to the cap
    ctx.update(_request("b", [2, 4], 2), [6])
    assert ctx.requests["b"].rows is None  # all in the draft vocabulary
    ctx.drop(["a", "unknown"])
    assert set(ctx.requests) == {"b"}


def test_a_context_token_is_drafted_where_it_outscores_the_heads_draft():
    ctx = _context()
    ctx.update(_request("r", [3, 5], 2), [])
    normed = torch.stack([EMBEDDING[5] * 3, EMBEDDING[5] * 3])  # row 0 favours token 5
    scores = (EMBEDDING[[3, 5]] @ normed[0]).tolist()
    head_logits = [max(scores) - 1.0, max(scores)]  # row 0: below token 5's; row 1: a tie
    ids, conf = [10, 12], [0.6, 0.6]
    ctx.pick(["r", "r"], normed, head_logits, ids, conf)
    assert ids == [5, 12]  # a tie stays with the head's own draft
    for n, drafted in enumerate([max(scores), head_logits[1]]):
        # the head's 0.6 stands for a softmax whose normalizer is e^head / 0.6; add the context's
        z = math.exp(head_logits[n]) / 0.6 + sum(math.exp(s) for s in scores)
        assert math.isclose(conf[n], math.exp(drafted) / z, rel_tol=1e-6)
    ids = [10]
    ctx.pick(["other"], normed[:1], [0.0], ids, None)  # a request with no context tokens
    assert ids == [10]
