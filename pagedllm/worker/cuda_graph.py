"""CUDA graphs for decode-only steps: the model's forward pass captured once per batch-size
bucket at start, replayed with the step's inputs copied into static buffers and the bucket's
spare rows padded (slot -1: no K/V written; one-token sequences over block 0, whose output is
dropped). Steps with a prompt chunk, a LoRA adapter, a pipeline stage or more rows than the
largest bucket run eagerly.

Without CUDA (the tests' CPU runs under Triton's interpreter) the same padding runs eagerly,
so the path that feeds a graph is checked where no graph can be captured.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import nn

from pagedllm.forward_context import AttentionMetadata, TritonMetadata, set_forward_context

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's buckets: 1, 2, 4, then every multiple of 8, up to the first that holds max_num_seqs."""
    sizes = [1, 2, 4] + list(range(8, max_num_seqs + 8, 8))
    return sizes[: bisect.bisect_left(sizes, max_num_seqs) + 1]


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, sizes: list[int], max_blocks_per_seq: int, device: torch.device) -> None:
        self.model = model
        self.sizes = sorted(sizes)
        self.device = device
        self.capture = device.type == "cuda"
        n = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a bucket: views of the static buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], decode_token_idx=None, decode_block_tables=None,
            decode_seq_lens=None, prefills=[],
            triton=TritonMetadata(self.query_start_loc[: size + 1], self.seq_lens[:size], self.block_tables[:size], 1),
        )

    def _forward(self, size: int) -> torch.Tensor:
        with set_forward_context(self.metadata(size)):
            return self.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first, in one memory pool (the smaller ones reuse it)."""
        if not self.capture:
            return
        start = time.perf_counter()
        self._pad(0)
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton's compilation and cuBLAS's workspaces, outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)
        self._pad(0)
        logger.info("CUDA graphs: %d decode batch sizes (1 to %d) captured in %.1f s", len(self.sizes),
                    self.sizes[-1], time.perf_counter() - start)

    def bucket(self, md: AttentionMetadata | None, num_tokens: int) -> int | None:
        """The bucket a step runs in, or None when it must run eagerly: a step of decodes only
        (one token each after context), no more than the largest bucket, within the block tables."""
        if md is None or md.triton is None or md.prefills or md.triton.max_query_len != 1:
            return None
        if num_tokens > self.sizes[-1] or md.triton.block_tables.shape[1] > self.max_blocks:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def _pad(self, n: int) -> None:
        """Rows from n on: padding (no K/V written, one key each, in block 0)."""
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.slot_mapping[n:].fill_(-1)
        self.seq_lens[n:].fill_(1)
        self.block_tables[n:, 0].zero_()
        torch.arange(n, self.query_start_loc.shape[0], out=self.query_start_loc[n:])

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states, from bucket `size`'s graph (eagerly on the same buffers
        without CUDA)."""
        n = input_ids.shape[0]
        t = md.triton
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(t.seq_lens, non_blocking=True)
        self.query_start_loc[: n + 1].copy_(t.query_start_loc, non_blocking=True)
        self.block_tables[:n, : t.block_tables.shape[1]].copy_(t.block_tables, non_blocking=True)
        if n < size:
            self._pad(n)
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
            return out[:n]
        return self._forward(size)[:n]
