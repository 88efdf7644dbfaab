"""An induction start for an EAGLE-3 head (`train_eagle.py --induction-init`): one of its KV heads
set up to copy, before training.

Why: the default model's greedy answers repeat the user's words, so most answer tokens continue
an earlier occurrence of the token just read. Gradient descent finds that match (a token against
its earlier occurrences, over the whole vocabulary) slowly, and a head trained from a random start
copies training-style words far better than unseen ones. Set by hand, the match holds for any
token of the draft vocabulary from the first step:

- query, from the token fed at row t (x(t+1)): the whitened top directions of the draft
  vocabulary's normalized embedding rows;
- key, from the fused target state at row j, which carries the token x(j) the target read there: a
  ridge regression of that same projection of x(j)'s embedding on the normalized `fc` output;
- value, from the token fed at row j (x(j+1)): the top directions of its embedding, which `o_proj`
  maps back, scaled to the residual's size, so the LM head (the embedding rows) reads x(j+1).

Query and key use only the rotary pairs that turn less than half a radian over 512 positions, so
the match does not depend on distance. The head's other KV heads keep their random start.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def slow_rotary_dims(head_dim: int, theta: float, span: int = 512) -> list[int]:
    """The dims (both halves of each rotate-half pair) whose rotation over `span` positions stays
    under half a radian."""
    half = head_dim // 2
    pairs = [i for i in range(half) if span * theta ** (-2 * i / head_dim) < 0.5]
    return pairs + [i + half for i in pairs]


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], eps=1e-6)


@torch.no_grad()
def induction_init(head, feats: list[torch.Tensor], embeds: list[torch.Tensor], lm_rows: torch.Tensor,
                   ratio: float = 5.0, sharpness: float = 4.0) -> dict[str, float]:
    """Set the last KV head of `head` (train_eagle.Head, LM head already the embedding rows
    `lm_rows`) and its query heads to copy, fitting the key on the sequences `feats`/`embeds`.
    `ratio`: the copied embedding's size against the residual's; `sharpness`: the query's scale."""
    h, hd, rep = lm_rows.shape[1], head.head_dim, head.heads // head.kv_heads
    dims = slow_rotary_dims(hd, head.theta)
    if not dims or hd > h:
        raise ValueError(f"a copying head needs rotary dims that turn slowly (head_dim {hd}, rope_theta "
                         f"{head.theta}: {len(dims)}) and head_dim at most the hidden size ({h})")
    rows = _unit_rms(lm_rows.float())
    _, s, vt = torch.linalg.svd(rows - rows.mean(0), full_matrices=False)
    match = vt[: len(dims)] / s[: len(dims), None] * math.sqrt(len(rows))  # unit variance over the vocabulary
    copy = vt[:hd]
    hidden = torch.cat([head.fc(f[:-1]) for f in feats])
    x = _unit_rms(hidden)
    y = torch.cat([_unit_rms(e[:-1]) for e in embeds]) @ match.T  # row j's key: the token the target read at j
    key = torch.linalg.solve(x.T @ x + 1e-2 * len(x) / h * torch.eye(h), x.T @ y).T
    fit = 1 - ((x @ key.T - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
    fed = torch.cat([_unit_rms(e[1:]) for e in embeds])
    gain = ratio * hidden.norm(dim=-1).median() / (fed @ copy.T @ copy).norm(dim=-1).median()
    kv = head.kv_heads - 1
    q = head.q_proj.weight.view(head.heads, hd, 2 * h)
    o = head.o_proj.weight.view(h, head.heads, hd)
    for qh in range(kv * rep, (kv + 1) * rep):
        q[qh].zero_()
        q[qh, dims, :h] = sharpness * match
        o[:, qh].copy_(gain / rep * copy.T)
    k = head.k_proj.weight.view(head.kv_heads, hd, 2 * h)
    k[kv].zero_()
    k[kv, dims, h:] = key
    v = head.v_proj.weight.view(head.kv_heads, hd, 2 * h)
    v[kv].zero_()
    v[kv, :, :h] = copy
    decoded = ((rows @ copy.T @ copy) @ lm_rows.float().T).argmax(-1) == torch.arange(len(rows))
    return {"key_fit_r2": float(fit), "copy_decode_top1": float(decoded.float().mean()), "gain": float(gain)}


@torch.no_grad()
def copy_attention_hits(head, feats, embeds, tokens, prompt_lens) -> float:
    """Of the answer rows t whose token x(t+1) occurred earlier in the sequence, the share at
    which the copying heads' top attention (step 0) lands on a row j with x(j) == x(t+1)."""
    hit = total = 0
    qh = head.heads - 1
    for f, e, tk, plen in zip(feats, embeds, tokens, prompt_lens):
        n = len(e) - 1
        q, k, _ = head.qkv(e[1:], head.fc(f[:n]), torch.arange(n))
        scores = (q[:, qh] @ k[:, qh].T).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        top = scores.argmax(-1)
        for t in range(plen - 1, n - 1):
            if (tk[: t + 1] == tk[t + 1]).any():
                total += 1
                hit += int(tk[top[t]] == tk[t + 1])
    return hit / max(1, total)
