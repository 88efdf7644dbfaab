"""The EAGLE-3 head's decoder layer replayed as bound C kernel calls (decode_plan.py's building
blocks): the drafter runs its one layer at least once every speculative step, on 1 to k + 1 rows
a request, and its ~25 module calls cost more than their kernels. The kernels, their arguments
and their order are those of `Eagle3Layer.forward` on the C kernel path, so the drafts are
bit-identical to it (tests/worker/test_eagle_plan.py). A head whose linears have no weight-only
kernels (a float target's head), a step with a prompt chunk the attention does not run as
decodes, or PAGEDLLM_DECODE_PLAN=0 keeps the module path.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from pagedllm import envs
from pagedllm.forward_context import AttentionMetadata
from pagedllm.spec_decode.eagle3 import Eagle3Head
from pagedllm.worker.decode_plan import MAX_PLAN_ROWS, DecodePlan, PlanBuffers, Unsupported, rows_run_as_decodes

logger = logging.getLogger(__name__)


class Eagle3LayerPlan(DecodePlan):
    """The head's layer for `rows` rows: [fc over the target's fused layers,] the two input norms
    side by side, attention, the MLP and both residual adds; returns the pre-norm output."""

    def __init__(self, head: Eagle3Head, rows: int, buffers: PlanBuffers) -> None:
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

    def run_layer(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                  md: AttentionMetadata) -> torch.Tensor:
        """`Eagle3Head.forward`: `hidden` the target's layers side by side, or the head's own rows."""
        self._write_step(positions, md)
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


class Eagle3PlanRunner:
    """The head's plans by row count, on one set of buffers, made again when the KV cache or the
    thread count changes. Called with a step's rows: their output, or None for the module path."""

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head
        self.attn = head.layer.self_attn.attn
        self.windows = {self.attn.sliding_window}
        self.key: tuple[int, int] | None = None  # the KV cache and thread count the plans are for
        self.plans: dict[int, Eagle3LayerPlan | None] = {}
        self.buffers: PlanBuffers | None = None

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 md: AttentionMetadata) -> torch.Tensor | None:
        rows = embeds.shape[0]
        if rows > MAX_PLAN_ROWS or md.triton is not None:
            return None
        key = (self.attn.kv_cache.data_ptr(), torch.get_num_threads())
        if key != self.key:
            if self.attn.kv_cache.numel() == 0 or not envs.PAGEDLLM_DECODE_PLAN:
                return None
            self.key, self.plans = key, {}
            head = self.head
            self.buffers = PlanBuffers(head.layer.self_attn, head.layer.mlp, head.norm.weight.shape[0],
                                       MAX_PLAN_ROWS, embeds.dtype, head.fc.in_features)
        if not rows_run_as_decodes(md, self.buffers.block_table.shape[1], self.windows):
            return None
        if rows not in self.plans:
            try:
                self.plans[rows] = Eagle3LayerPlan(self.head, rows, self.buffers)
            except Unsupported as e:
                logger.debug("EAGLE-3 head plan for %d rows off: %s", rows, e)
                self.plans[rows] = None
        plan = self.plans[rows]
        return None if plan is None else plan.run_layer(embeds, hidden, positions, md)

