"""The EAGLE-3 head's decoder layer, and its final norm and LM head, replayed as bound C kernel
calls (decode_plan.py's building blocks): the drafter runs its one layer at least once every
speculative step, on 1 to k + 1 rows a request, and its ~25 module calls cost more than their
kernels. A pass's positions, slots and block tables are written from the requests' own lists,
with no step inputs built. The kernels, their arguments and their order are those of
`Eagle3Layer.forward` and `Eagle3Head.draft_logits` on the C kernel path, so the drafts are
bit-identical to them (tests/worker/test_eagle_plan.py). A head whose linears have no
weight-only kernels (a float target's head), a pass with a prompt chunk the attention does not
run as decodes, or PAGEDLLM_DECODE_PLAN=0 keeps the module path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import torch

from pagedllm import envs
from pagedllm.model_executor.layers.attention import causal_chunk_runs_as_decodes
from pagedllm.spec_decode.eagle3 import Eagle3Head
from pagedllm.worker.decode_plan import MAX_PLAN_ROWS, DecodePlan, PlanBuffers, Unsupported

logger = logging.getLogger(__name__)


class Eagle3LayerPlan(DecodePlan):
    """The head's layer for `rows` rows: [fc over the target's fused layers,] the two input norms
    side by side, attention, the MLP and both residual adds; returns the pre-norm output."""

    def __init__(self, head: Eagle3Head, rows: int, buffers: PlanBuffers, logits: torch.Tensor) -> None:
        """`logits`: [MAX_PLAN_ROWS, draft vocabulary], shared by the plans like `buffers`."""
        layer, n = head.layer, rows
        self._bind_buffers(rows, buffers)
        width = self.hidden.shape[1]
        self.embeds = buffers.normed.new_zeros(n, width)
        self.feats = buffers.aux[:n]
        normed_embeds, normed_hidden = (buffers.normed.new_zeros(n, width) for _ in range(2))
        cat, proj = buffers.normed.new_zeros(n, 2 * width), buffers.proj[:n]
        self._linear(head.fc, self.feats, self.hidden)
        fc_calls, self.calls = self.calls, []
        self._rms(layer.input_layernorm, self.embeds, normed_embeds)
        self._rms(layer.hidden_norm, self.hidden, normed_hidden)
        self.calls.append(partial(torch.cat, (normed_embeds, normed_hidden), -1, out=cat))
        self._attention(layer.self_attn, cat, proj)
        self._add(proj)
        self._rms(layer.post_attention_layernorm, self.hidden, self.normed)
        self._mlp(layer.mlp, self.normed, proj)
        self._add(proj)
        self.fused_calls = fc_calls + self.calls  # the first pass over the target's rows
        # The drafts' logits from `rows` rows of the head's output: its final norm and LM head.
        layer_calls, self.calls = self.calls, []
        self.draft_in, self.draft_normed = (buffers.normed.new_zeros(n, width) for _ in range(2))
        self.logits = logits[:n]
        try:
            self._rms(head.norm, self.draft_in, self.draft_normed)
            self._linear(head.lm_head, self.draft_normed, self.logits)
            self.logit_calls: list | None = self.calls
        except Unsupported:
            self.logit_calls = None
        self.calls = layer_calls

    def run_layer(self, embeds: torch.Tensor, hidden: torch.Tensor, query_lens: list[int], starts: list[int],
                  block_ids: Sequence[Sequence[int]], block_size: int) -> torch.Tensor:
        """`Eagle3Head.forward` for each request's `query_lens[i]` rows after its `starts[i]`
        cached positions: `hidden` the target's layers side by side, or the head's own rows."""
        self._write_rows(query_lens, starts, block_ids, block_size)
        self.embeds.copy_(embeds)
        if hidden.shape[-1] == self.hidden.shape[-1]:
            self.hidden.copy_(hidden)
            calls = self.calls
        else:
            self.feats.copy_(hidden)
            calls = self.fused_calls
        for call in calls:
            call()
        return self.hidden.clone()

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor | None:
        """`Eagle3Head.draft_logits` of the head's output rows (a view of this plan's buffer,
        valid until its next call), or None where the LM head has no bound kernel."""
        if self.logit_calls is None:
            return None
        self.draft_in.copy_(out)
        for call in self.logit_calls:
            call()
        return self.logits

    def _write_rows(self, query_lens: list[int], starts: list[int], block_ids: Sequence[Sequence[int]],
                    block_size: int) -> None:
        """Each row's position, slot, keys and blocks, written from the requests' own lists (no
        step inputs built: a chained pass is one row, and building them cost more than its kernels)."""
        pos, slot, lens, table = self._positions_np, self._slot_np, self._seq_len_np, self._table_np
        row = 0
        for n, start, ids in zip(query_lens, starts, block_ids):
            blocks = -(-(start + n) // block_size)
            table[row : row + n, :blocks] = ids[:blocks]
            for p in range(start, start + n):
                pos[row], lens[row] = p, p + 1
                slot[row] = ids[p // block_size] * block_size + p % block_size
                row += 1


class Eagle3PlanRunner:
    """The head's plans by row count, on one set of buffers, made again when the KV cache or the
    thread count changes. Called with a step's rows: their output, or None for the module path."""

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head
        self.attn = head.layer.self_attn.attn
        self.key: tuple[int, int] | None = None  # the KV cache and thread count the plans are for
        self.plans: dict[int, Eagle3LayerPlan | None] = {}
        self.buffers: PlanBuffers | None = None
        self.logits: torch.Tensor | None = None
        self.normed: torch.Tensor | None = None  # the LM head's input rows of the last `draft_logits`

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, query_lens: list[int], starts: list[int],
                 block_ids: Sequence[Sequence[int]], block_size: int) -> torch.Tensor | None:
        rows = embeds.shape[0]
        if rows > MAX_PLAN_ROWS:
            return None
        key = self._key()
        if key != self.key:
            if self.attn.kv_cache.numel() == 0 or not envs.PAGEDLLM_DECODE_PLAN:
                return None
            self.key, self.plans = key, {}
            head = self.head
            self.buffers = PlanBuffers(head.layer.self_attn, head.layer.mlp, head.norm.weight.shape[0],
                                       MAX_PLAN_ROWS, embeds.dtype, head.fc.in_features)
            self.logits = embeds.new_zeros(MAX_PLAN_ROWS, head.draft_vocab_size)
        if not self._runs_as_decodes(query_lens, starts, block_size):
            return None
        plan = self._plan(rows)
        return None if plan is None else plan.run_layer(embeds, hidden, query_lens, starts, block_ids, block_size)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor | None:
        """The drafts' logits from the head's output rows, on the plans' bound calls where the
        plans run (else None: the head's modules)."""
        self.normed = None
        if self.key != self._key() or out.shape[0] > MAX_PLAN_ROWS:
            return None
        plan = self._plan(out.shape[0])
        logits = None if plan is None else plan.draft_logits(out)
        if logits is not None:
            self.normed = plan.draft_normed
        return logits

    def _key(self) -> tuple[int, int]:
        return self.attn.kv_cache.data_ptr(), torch.get_num_threads()

    def _plan(self, rows: int) -> Eagle3LayerPlan | None:
        if rows not in self.plans:
            try:
                self.plans[rows] = Eagle3LayerPlan(self.head, rows, self.buffers, self.logits)
            except Unsupported as e:
                logger.debug("EAGLE-3 head plan for %d rows off: %s", rows, e)
                self.plans[rows] = None
        return self.plans[rows]

    def _runs_as_decodes(self, query_lens: list[int], starts: list[int], block_size: int) -> bool:
        """`rows_run_as_decodes` for the pass's requests: each row's blocks within the buffers'
        table, and every request but a decode (one row after cached ones) a chunk the attention
        runs as decodes."""
        max_blocks = self.buffers.block_table.shape[1]
        for n, start in zip(query_lens, starts):
            if -(-(start + n) // block_size) > max_blocks:
                return False
            if (n > 1 or start == 0) and not causal_chunk_runs_as_decodes(start, n, self.attn.sliding_window):
                return False
        return True
