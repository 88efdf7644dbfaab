"""Lossless verification of draft tokens (speculative sampling).

For each request the target scored k drafts plus one more position, and the sampler already
drew one token t_j from the target distribution p_j at every position. Then:

- a draft that is certain (n-gram proposals, greedy requests: q is one-hot) is accepted
  iff it equals t_j. P(accept) = p_j(d_j), and on rejection t_j is a draw from p_j without
  d_j, i.e. from the normalised max(0, p_j - q_j): exactly the rule below with a one-hot q;
- a draft sampled from a draft model's q_j is accepted with probability min(1, p_j / q_j);
  on rejection a token is drawn from the normalised max(0, p_j - q_j);
- when all k drafts are accepted, t_k (a draw from p_k) is the bonus token.

The output is distributed exactly as sampling from the target alone.
"""

from __future__ import annotations

import torch

from pagedllm.model_executor.layers.sampler import random_draw
from pagedllm.model_executor.layers.sampler import sampling_probs as target_probs

__all__ = ["accept_certain", "accept_sampled", "target_probs"]


def accept_certain(drafts: list[int], target_tokens: list[int]) -> list[int]:
    """One-hot drafts: keep them while they equal the target's draws, then the target's token."""
    n = 0
    while n < len(drafts) and drafts[n] == target_tokens[n]:
        n += 1
    return drafts[:n] + [target_tokens[n]]


def accept_sampled(
    drafts: list[int],
    target_tokens: list[int],
    p: torch.Tensor,
    q: torch.Tensor,
    generator: torch.Generator | None,
) -> list[int]:
    """Drafts drawn from q ([k, V]) against the target's p ([k + 1, V]); target_tokens are the
    sampler's draws from p (the last one is the bonus token)."""
    k = len(drafts)
    idx = torch.tensor(drafts, device=p.device).unsqueeze(1)
    p_draft = p[:k].gather(1, idx).squeeze(1)
    q_draft = q[:k].gather(1, idx).squeeze(1)
    u = torch.rand(k, generator=generator, device=p.device)
    rejected = torch.nonzero(u * q_draft >= p_draft).flatten()  # accept iff u < p / q
    if not rejected.numel():
        return drafts + [target_tokens[k]]
    n = int(rejected[0])
    residual = (p[n] - q[n]).clamp_(min=0)
    if float(residual.sum()) <= 0:  # p == q where it matters: any draw from p is right
        residual = p[n]
    return drafts[:n] + [int(random_draw(residual[None], {0: generator}, generator)[0])]
