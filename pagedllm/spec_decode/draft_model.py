"""Drafts from a smaller model with the target's vocabulary.

The draft model has its own paged KV cache with the target's block ids and slots: each
step it first catches up on the tokens the target just verified (plus the new token), in
one batched pass, then proposes k tokens for the whole batch in k - 1 batched decode
passes. Positions holding rejected drafts are simply computed again by the next catch-up.

It runs below the worker: the model runner hands it its step-input builder (the one its own
forward passes use, so both models address the same slots) and its requests' states.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from pagedllm.config import EngineConfig
from pagedllm.forward_context import set_forward_context
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.sampler import SamplingMetadata, greedy_argmax, random_draw
from pagedllm.model_executor.loader.model_loader import get_model
from pagedllm.spec_decode.rejection_sampler import target_probs


class DraftingRequest(Protocol):
    """What the proposer reads of a request's state in the runner's batch."""

    req_id: str
    token_ids: list[int]  # known tokens, then the drafts this step verified
    spec_token_ids: list[int]
    start_pos: int  # tokens whose K/V the cache holds
    block_ids: list[int]


class MetadataBuilder(Protocol):
    def build(self, reqs: Sequence[Any]) -> SamplingMetadata: ...


# (token ids per request, their start positions, their block ids, block size, device) → the
# step's inputs (`worker.step_inputs.StepInputs`: input_ids, positions, attn_metadata, ...).
InputBuilder = Callable[[Sequence[Sequence[int]], Sequence[int], Sequence[Sequence[int]], int, torch.device], Any]


class KVDrafter:
    """What the drafters with layers in the paged KV cache share: the number of drafts, the
    cache's geometry and the runner's step-input builder."""

    def __init__(self, config: EngineConfig, device: torch.device, prepare_inputs: InputBuilder) -> None:
        self.k = config.speculative_config.num_speculative_tokens
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.scheduler_config.max_model_len
        self.device = device
        self.prepare_inputs = prepare_inputs

    def budget(self, num_blocks: int, seq_len: int, max_drafts: int | None = None) -> int:
        """Drafts a request of `seq_len` tokens (the new one included) can take: at most k (or
        `max_drafts`), within the slots of its `num_blocks` blocks (the drafter writes K/V up to
        the next-to-last draft's position) and below max_model_len."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        return max(0, min(k, num_blocks * self.block_size - seq_len + 1, self.max_model_len - seq_len))

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget finished requests (a drafter that keeps state per request overrides this)."""


class DraftModelProposer(KVDrafter):
    def __init__(self, config: EngineConfig, device: torch.device, generator: torch.Generator,
                 prepare_inputs: InputBuilder) -> None:
        super().__init__(config, device, prepare_inputs)
        self.generator = generator  # for unseeded random requests
        self.model = get_model(config.speculative_config.draft_model_config, device)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # req_id → q ([num drafts, V] float32) of the last sampled proposal; greedy requests have none.
        self.draft_probs: dict[str, torch.Tensor] = {}

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.draft_probs.pop(req_id, None)

    @torch.inference_mode()
    def propose(
        self,
        reqs: list[DraftingRequest],
        new_tokens: list[list[int] | None],
        sampling_metadata: MetadataBuilder,
        max_drafts: int | None = None,
    ) -> list[list[int] | None]:
        """Catch up on the step's verified tokens, then draft (at most `max_drafts`; 0: only
        catch up)."""
        # 1. Catch up: the verified part of what the target just computed, plus the new token.
        token_ids = []
        for r, new in zip(reqs, new_tokens):
            verified = r.token_ids[: len(r.token_ids) - len(r.spec_token_ids)]
            token_ids.append(verified + new if new is not None else verified)
        step = self.prepare_inputs(token_ids, [r.start_pos for r in reqs], [r.block_ids for r in reqs],
                              self.block_size, self.device)
        with set_forward_context(step.attn_metadata):
            hidden = self.model(step.input_ids, step.positions)

        # How many drafts each request can take: its block table's lookahead slots, max_model_len.
        rows = [i for i, new in enumerate(new_tokens) if new is not None]
        seq_lens = [int(step.starts[i] + step.query_lens[i]) for i in rows]  # T: tokens incl. the new one
        budget = [self.budget(len(reqs[i].block_ids), t, max_drafts) for i, t in zip(rows, seq_lens)]
        keep = [j for j, b in enumerate(budget) if b > 0]
        rows, seq_lens, budget = [rows[j] for j in keep], [seq_lens[j] for j in keep], [budget[j] for j in keep]
        proposals: list[list[int] | None] = [None] * len(reqs)
        if not rows:
            return proposals
        active = [reqs[i] for i in rows]
        md = sampling_metadata.build(active)
        self.drop(r.req_id for r in active)
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        logits = self.model.compute_logits(hidden[torch.from_numpy(step.cu_end[rows] - 1).to(self.device)])
        live = list(range(len(rows)))  # indices into rows still drafting
        for j in range(max(budget)):
            tokens = self._sample(logits, md, live, probs)
            for a, tok in zip(live, tokens):
                drafts[a].append(tok)
            live = [a for a in live if len(drafts[a]) < budget[a]]
            if not live:
                break
            # 2. Feed the last draft of each live request at the next position.
            step = self.prepare_inputs([[drafts[a][-1]] for a in live], [seq_lens[a] - 1 + j + 1 for a in live],
                                  [active[a].block_ids for a in live], self.block_size, self.device)
            with set_forward_context(step.attn_metadata):
                logits = self.model.compute_logits(self.model(step.input_ids, step.positions))
        for a, i in enumerate(rows):
            proposals[i] = drafts[a]
            if probs[a]:
                self.draft_probs[active[a].req_id] = torch.stack(probs[a])
        return proposals

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata, live: list[int],
                probs: list[list[torch.Tensor]]) -> list[int]:
        """One draft per live request: the draft's argmax for greedy requests, else a draw from
        its distribution q (same temperature / top-k / top-p as the target), q kept for verification."""
        out = greedy_argmax(logits).tolist()
        if md.all_greedy:
            return out
        greedy = md.greedy.tolist()  # one device sync, not one per row
        sampled = [n for n, a in enumerate(live) if not greedy[a]]
        if not sampled:
            return out
        dev = logits.device
        q_rows = target_probs(logits[torch.tensor(sampled, device=dev)], md,
                              torch.tensor([live[n] for n in sampled], device=dev))
        gens = {j: md.generators[live[n]] for j, n in enumerate(sampled) if live[n] in md.generators}
        tokens = random_draw(q_rows, gens, self.generator).tolist()
        for q, n, tok in zip(q_rows, sampled, tokens):
            out[n] = tok
            probs[live[n]].append(q)
        return out
