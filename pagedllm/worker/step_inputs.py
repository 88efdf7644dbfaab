"""Flattened model inputs and attention metadata for one forward pass, built in bulk with numpy.

Shared by the target model and a draft model: both read and write K/V through the same
block tables, so one function turns (tokens, start positions, block ids) into slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.forward_context import AttentionMetadata, PrefillSegment, TritonMetadata
from pagedllm.model_executor.layers.triton_ops import use_triton_attention


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64, all requests' new tokens back to back
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    query_lens: np.ndarray  # [R] tokens per request
    starts: np.ndarray  # [R] tokens already in the cache before this pass
    cu_start: np.ndarray  # [R] offset of each request's first token in the flat batch
    cu_end: np.ndarray  # [R] offset past its last token
    token_type_ids: torch.Tensor | None = None  # [T], BERT's segment of each token (text pairs)


@dataclass(slots=True)
class TokenLayout:
    """Where each request's tokens sit in the flat batch, and their positions."""

    query_lens: np.ndarray  # [R]
    starts: np.ndarray  # [R]
    cu_start: np.ndarray  # [R]
    cu_end: np.ndarray  # [R]
    req_of_token: np.ndarray  # [T] the request of each flat token
    positions: np.ndarray  # [T]


def token_layout(query_lens: np.ndarray, starts: np.ndarray) -> TokenLayout:
    cu_end = np.cumsum(query_lens)
    cu_start = cu_end - query_lens
    req_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    positions = np.arange(int(cu_end[-1])) - cu_start[req_of_token] + starts[req_of_token]
    return TokenLayout(query_lens, starts, cu_start, cu_end, req_of_token, positions)


def prepare_inputs(
    token_ids: Sequence[Sequence[int]],
    starts: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> StepInputs:
    """The step's inputs from per-request lists (a draft model's steps, warm-up, profiling); the
    runner's batch gathers the same arrays from its rows (`InputBatch.prepare_inputs`)."""
    num_reqs = len(token_ids)
    query_lens = np.fromiter((len(t) for t in token_ids), np.int64, num_reqs)
    layout = token_layout(query_lens, np.asarray(starts, dtype=np.int64))
    max_blocks = int(-(-(layout.starts + query_lens).max() // block_size))
    block_table = np.zeros((num_reqs, max_blocks), np.int64)
    for i, ids in enumerate(block_ids):
        n = min(len(ids), max_blocks)
        block_table[i, :n] = ids[:n]
    input_ids = np.fromiter((t for toks in token_ids for t in toks), np.int64, len(layout.positions))
    return build_step(input_ids, layout, block_table, block_size, device)


def build_step(input_ids: np.ndarray, layout: TokenLayout, block_table: np.ndarray, block_size: int,
               device: torch.device, bidirectional: list[list[tuple[int, int]]] | None = None) -> StepInputs:
    """Slots and attention metadata from the flat tokens and each request's block table [R, B]
    (B covering its longest sequence). `bidirectional`: per request, the position spans whose
    tokens attend to each other both ways (a Gemma 3 image); such a step takes the torch path,
    which masks them (the Triton kernels are causal only)."""
    query_lens, starts, cu_start, cu_end = layout.query_lens, layout.starts, layout.cu_start, layout.cu_end
    positions, req_of_token = layout.positions, layout.req_of_token
    seq_lens = starts + query_lens
    slots = block_table[req_of_token, positions // block_size] * block_size + positions % block_size

    is_decode = (query_lens == 1) & (starts > 0)
    decode_rows = np.nonzero(is_decode)[0]
    md = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        decode_token_idx=None,
        decode_block_tables=None,
        decode_seq_lens=None,
        prefills=[],
    )
    # The Triton kernels read the whole batch from three arrays; the per-row split below is then
    # bookkeeping (an encoder's prompt lengths) and stays on the host.
    split_device = device
    if use_triton_attention(device) and not (bidirectional and any(bidirectional)):
        md.triton = TritonMetadata(
            query_start_loc=torch.from_numpy(np.concatenate(([0], cu_end)).astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(block_table.astype(np.int32)).to(device),
            max_query_len=int(query_lens.max()),
        )
        split_device = torch.device("cpu")
    if len(decode_rows):
        d_lens = seq_lens[decode_rows]
        d_blocks = int(-(-d_lens.max() // block_size))
        md.decode_token_idx = torch.from_numpy(cu_start[decode_rows]).to(split_device)
        md.decode_block_tables = torch.from_numpy(block_table[decode_rows, :d_blocks]).to(split_device)
        md.decode_seq_lens = d_lens
    for i in np.nonzero(~is_decode)[0]:
        n_blocks = int(-(-seq_lens[i] // block_size))
        md.prefills.append(
            PrefillSegment(
                token_start=int(cu_start[i]),
                query_len=int(query_lens[i]),
                context_len=int(starts[i]),
                block_table=torch.from_numpy(block_table[i, :n_blocks]).to(split_device),
                bidirectional=bidirectional[i] if bidirectional else [],
            )
        )
    return StepInputs(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        attn_metadata=md,
        query_lens=query_lens,
        starts=starts,
        cu_start=cu_start,
        cu_end=cu_end,
    )
