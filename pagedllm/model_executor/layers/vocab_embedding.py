"""Token embedding and the LM head, which computes logits only for rows to sample."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.layers.cpu_gemm import packed_linear
from pagedllm.model_executor.layers.linear import default_weight_loader
from pagedllm.model_executor.layers.quantization import QuantizedLMHead


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Owns its weight unless tied, in which case it reads the embedding's."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied_to = tied_to
        self.quant: QuantizedLMHead | None = None  # set by loader/quantize.py
        self.packed: torch.Tensor | None = None  # set by loader/cpu_pack.py
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
            self.weight.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        # Left in the model dtype: greedy argmax needs no float32 copy of [B, vocab]
        # (bf16 → fp32 is exact, so the sampler converts only when it must).
        if self.quant is not None:
            logits = self.quant(hidden, weight)
        elif self.packed is not None:
            logits = packed_linear(hidden, self.packed, None)
        else:
            logits = F.linear(hidden, weight)
        if softcap:
            logits = torch.tanh(logits.float() / softcap) * softcap
        return logits
