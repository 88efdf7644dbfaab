"""Attention metadata for the current forward pass, set once per step by the runner.

Keeping it in a context (not in forward() arguments) lets every model keep the
signature `forward(input_ids, positions)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class PrefillSegment:
    """One request whose query has more than one token (or context before it)."""

    token_start: int  # offset into the flattened batch
    query_len: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks] int64, enough blocks for context + query
    # Position spans [start, end) whose tokens attend to each other both ways (an image's tokens
    # in a prefix-LM such as Gemma 3); the rest is causal. Empty: all causal.
    bidirectional: list[tuple[int, int]] = field(default_factory=list)
    # sliding window (None: full) → (block-table slice, number of keys, attention tiles), and "rows"
    # → (block tables, lengths) of its rows run as decodes; built by the first layer that needs
    # them, shared by the others.
    views: dict = field(default_factory=dict)


@dataclass(slots=True)
class TritonMetadata:
    """What the Triton attention kernel reads, on the device: every request of the step, in batch
    order. A CUDA graph's bucket holds views of its static buffers."""

    query_start_loc: torch.Tensor  # [R + 1] int32: each request's first token in the flat batch
    seq_lens: torch.Tensor  # [R] int32: context + this step's tokens
    block_tables: torch.Tensor  # [R, max_blocks] int32
    max_query_len: int  # picks the kernel's tile shape


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    # Decode requests (query of one token) are batched into one padded attention call.
    decode_token_idx: torch.Tensor | None  # [num_decodes] positions in the flat batch
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_seq_lens: np.ndarray | None  # [num_decodes] int64, including the new token
    prefills: list[PrefillSegment]
    # sliding window (None: full) → the DecodeView its layers read; built by the first layer
    # that needs it, shared by the others.
    decode_views: dict = field(default_factory=dict)
    # Set where the step runs the Triton kernels (CUDA; tests under Triton's interpreter): then
    # the fields above are only bookkeeping, on the host.
    triton: TritonMetadata | None = None


@dataclass(slots=True)
class DecodeView:
    """The keys a decode attention call reads: only the block-table columns that hold some
    sequence's keys within its window, and a mask for the rest (None when nothing is masked)."""

    block_tables: torch.Tensor  # [num_decodes, n] int64
    first_key: int  # keys [first_key, num_keys) of the gathered blocks are read
    num_keys: int
    masked_out: torch.Tensor | None  # [num_decodes, 1, 1, num_keys - first_key] bool


_current: AttentionMetadata | None = None
_lora_mask: torch.Tensor | None = None
_exact_logit_rows: torch.Tensor | None = None


@contextmanager
def set_forward_context(metadata: AttentionMetadata | None, lora_mask: torch.Tensor | None = None) -> Iterator[None]:
    """`lora_mask` [tokens, max_loras * max_rank]: which adapter slot's columns each token uses
    (layers/lora.py); None when no token of the step runs an adapter."""
    global _current, _lora_mask
    prev, _current = _current, metadata
    prev_mask, _lora_mask = _lora_mask, lora_mask
    try:
        yield
    finally:
        _current, _lora_mask = prev, prev_mask


def get_attention_metadata() -> AttentionMetadata | None:
    return _current


def get_lora_mask() -> torch.Tensor | None:
    return _lora_mask


@contextmanager
def exact_logit_rows(rows: torch.Tensor | None) -> Iterator[None]:
    """`rows` of the logits computed inside: those whose log-softmax goes back to a user (logprobs,
    prompt logprobs). An LM head that ranks the vocabulary on a copy (GGUFRankedHead) gives them
    the weights' own logits for every token, so their normalizer is the model's, not the copy's
    tail. None (or empty): no such rows."""
    global _exact_logit_rows
    prev, _exact_logit_rows = _exact_logit_rows, rows
    try:
        yield
    finally:
        _exact_logit_rows = prev


def get_exact_logit_rows() -> torch.Tensor | None:
    return _exact_logit_rows
