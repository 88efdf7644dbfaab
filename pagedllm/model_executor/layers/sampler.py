"""Batched sampling: one pass over the whole batch, per-request parameters as tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; rows with greedy=True are ignored
    top_k: torch.Tensor | None  # [B] int64, 0 where off; None if no row uses it
    top_p: torch.Tensor | None  # [B] float32, 1.0 where off; None if no row uses it
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    # row → generator, for requests with a seed: their draws do not depend on the batch.
    generators: dict[int, torch.Generator]


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for unseeded random rows

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logits: [B, V] float32 → sampled token ids [B]."""
        greedy_ids = logits.argmax(dim=-1)
        if md.all_greedy:
            return greedy_ids
        logits = logits / md.temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1)
        random_ids = self._exponential_race(probs, md.generators)
        return torch.where(md.greedy, greedy_ids, random_ids)

    def _exponential_race(
        self, probs: torch.Tensor, generators: dict[int, torch.Generator]
    ) -> torch.Tensor:
        """argmax(p / E) with E ~ Exp(1) is a sample from p (the Gumbel-max trick in
        another form); per-row generators make seeded rows batch-independent."""
        q = torch.empty_like(probs)
        if len(generators) < probs.shape[0]:
            q.exponential_(generator=self.generator)
        for row, gen in generators.items():
            q[row].exponential_(generator=gen)
        return probs.div_(q).argmax(dim=-1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus to -inf.

    top_k rows of 0 and top_p rows of 1.0 are off.
    """
    if top_k is not None:
        # A threshold from topk() avoids sorting the whole vocabulary for top-k.
        k_on = top_k > 0
        max_k = int(top_k.max())
        kth = logits.topk(max_k, dim=-1).values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
        kth = kth.masked_fill(~k_on.unsqueeze(1), float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is None:
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose mass is within 1 - top_p; always keep the top token.
    drop = cum <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)
