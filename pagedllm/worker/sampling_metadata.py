"""Per-step SamplingMetadata from the scheduled requests, plus the per-request state
that outlives a step (seeded generators, static logit bias)."""

from __future__ import annotations

import torch

from pagedllm.model_executor.layers.sampler import SamplingMetadata
from pagedllm.worker.input_batch import CachedRequestState


class SamplingMetadataBuilder:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.static_bias: dict[str, torch.Tensor] = {}

    def drop(self, req_ids) -> None:
        for req_id in req_ids:
            self.generators.pop(req_id, None)
            self.static_bias.pop(req_id, None)

    def build(self, reqs: list[CachedRequestState]) -> SamplingMetadata:
        params = [r.sampling_params for r in reqs]
        dev = self.device
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        md = SamplingMetadata(
            temperature=None, top_k=None, top_p=None, greedy=None, all_greedy=all_greedy, generators={},
            max_num_logprobs=max(logprobs) if logprobs else None,
        )
        for row, (r, p) in enumerate(zip(reqs, params)):
            self._add_masks(md, row, r)
            if p.needs_output_history:
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
        for row, (r, p) in enumerate(zip(reqs, params)):
            if p.seed is not None and not p.greedy:
                md.generators[row] = self._generator(r.req_id, p.seed)
        # top_k >= vocab keeps everything: off (as vLLM), and topk() could not take it.
        top_k = [p.top_k if p.top_k < self.vocab_size else 0 for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        md.temperature = torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(greedy, params)], dtype=torch.float32, device=dev
        )
        md.greedy = torch.tensor(greedy, device=dev)
        md.top_k = torch.tensor(top_k, device=dev) if any(top_k) else None
        md.top_p = torch.tensor(top_p, dtype=torch.float32, device=dev) if min(top_p) < 1.0 else None
        md.min_p = torch.tensor(min_p, dtype=torch.float32, device=dev) if any(min_p) else None
        return md

    def _generator(self, req_id: str, seed: int) -> torch.Generator:
        gen = self.generators.get(req_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[req_id] = gen
        return gen

    def _add_masks(self, md: SamplingMetadata, row: int, r: CachedRequestState) -> None:
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
