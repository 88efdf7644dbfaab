"""Repetition, frequency and presence penalties over token histories, batched."""

from __future__ import annotations

import torch


def _token_counts(histories: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] occurrence counts, built with one scatter_add over the padded histories."""
    counts = torch.zeros(len(histories), vocab + 1, dtype=torch.int32, device=device)
    width = max((len(h) for h in histories), default=0)
    if width:
        padded = torch.full((len(histories), width), vocab, dtype=torch.int64)  # pad → spare column
        for i, h in enumerate(histories):
            padded[i, : len(h)] = torch.tensor(h, dtype=torch.int64)
        counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, dtype=torch.int32, device=device))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
) -> torch.Tensor:
    """vLLM / OpenAI semantics: repetition divides positive (multiplies negative) logits of
    every token seen in prompt or output; frequency subtracts count × penalty and presence
    subtracts the penalty once, for tokens in the output only."""
    vocab = logits.shape[1]
    dev = logits.device
    out_counts = _token_counts(output_token_ids, vocab, dev)
    rep = torch.tensor(repetition, dtype=logits.dtype, device=dev).unsqueeze(1)
    if (rep != 1.0).any():
        seen = (_token_counts(prompt_token_ids, vocab, dev) > 0) | (out_counts > 0)
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, scaled, logits)
    freq = torch.tensor(frequency, dtype=logits.dtype, device=dev).unsqueeze(1)
    pres = torch.tensor(presence, dtype=logits.dtype, device=dev).unsqueeze(1)
    logits = logits - freq * out_counts.to(logits.dtype)
    return logits - pres * (out_counts > 0).to(logits.dtype)
