"""Per-step SamplingMetadata from the scheduled rows: the batch's per-row parameter arrays,
sliced, plus the per-request state that outlives a step (seeded generators, static logit bias).
Only the rows flagged when their request arrived (masks, penalties, seeds) are walked."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedllm.model_executor.layers.sampler import SamplingMetadata
from pagedllm.worker.input_batch import InputBatch, StepRow


class SamplingMetadataBuilder:
    def __init__(self, vocab_size: int, device: torch.device, batch: InputBatch) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.batch = batch
        self.generators: dict[str, torch.Generator] = {}
        self.static_bias: dict[str, torch.Tensor] = {}

    def drop(self, req_ids) -> None:
        for req_id in req_ids:
            self.generators.pop(req_id, None)
            self.static_bias.pop(req_id, None)

    def build(self, reqs: Sequence[StepRow]) -> SamplingMetadata:
        b, dev = self.batch, self.device
        idx = np.fromiter((r.state.row for r in reqs), np.int64, len(reqs))
        greedy = b.greedy[idx]
        all_greedy = bool(greedy.all())
        num_logprobs = b.num_logprobs[idx]
        md = SamplingMetadata(
            temperature=None, top_k=None, top_p=None, greedy=None, all_greedy=all_greedy, generators={},
            max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
        )
        for row in np.flatnonzero(b.has_masks[idx]).tolist():
            self._add_masks(md, row, reqs[row])
        for row in np.flatnonzero(b.reads_history[idx]).tolist():
            r = reqs[row]
            p = r.sampling_params
            if p.logits_processors:
                md.logits_processors[row] = (p.logits_processors, r.prompt_token_ids, r.output_token_ids)
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
                md.penalty_rows.append(row)
                md.prompt_token_ids.append(r.prompt_token_ids)
                md.output_token_ids.append(r.output_token_ids)
                md.presence_penalties.append(p.presence_penalty)
                md.frequency_penalties.append(p.frequency_penalty)
                md.repetition_penalties.append(p.repetition_penalty)
        if all_greedy:
            return md
        for row in np.flatnonzero(b.seeded[idx]).tolist():
            md.generators[row] = self._generator(reqs[row].req_id, reqs[row].sampling_params.seed)
        # top_k >= vocab keeps everything: off (as vLLM), and topk() could not take it.
        top_k = b.top_k[idx]
        top_k[top_k >= self.vocab_size] = 0
        top_p, min_p = b.top_p[idx], b.min_p[idx]
        md.temperature = torch.from_numpy(b.temperature[idx]).to(dev)
        md.greedy = torch.from_numpy(greedy).to(dev)
        md.top_k = torch.from_numpy(top_k).to(dev) if top_k.any() else None
        md.top_p = torch.from_numpy(top_p).to(dev) if top_p.min() < 1.0 else None
        md.min_p = torch.from_numpy(min_p).to(dev) if min_p.any() else None
        return md

    def _generator(self, req_id: str, seed: int) -> torch.Generator:
        gen = self.generators.get(req_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[req_id] = gen
        return gen

    def _add_masks(self, md: SamplingMetadata, row: int, r: StepRow) -> None:
        p = r.sampling_params
        if p.allowed_token_ids is not None or p.logit_bias:
            bias = self.static_bias.get(r.req_id)
            if bias is None:
                bias = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
                if p.allowed_token_ids is not None:
                    bias.fill_(float("-inf"))
                    bias[torch.tensor(p.allowed_token_ids, device=self.device)] = 0.0
                if p.logit_bias:  # one indexed add (the ids are distinct), not a launch per token on a GPU
                    ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=self.device)
                    bias[ids] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=self.device)
                self.static_bias[r.req_id] = bias
            md.static_bias[row] = bias
        banned: list[int] = []
        out = r.output_token_ids
        if len(out) < p.min_tokens:
            banned.extend(p.all_stop_token_ids)
        for seq in p.bad_words_token_ids:
            if len(seq) == 1 or (len(out) >= len(seq) - 1 and out[len(out) - len(seq) + 1 :] == seq[:-1]):
                banned.append(seq[-1])
        if banned:
            md.banned_token_ids[row] = banned
