"""EAGLE drafts: a decoder layer that predicts the target's next hidden state from the current
one and the token sampled from it; the target's LM head turns the prediction into a draft.

Its row at position p is fc([embed(token p+1); target hidden p]) through the layers, and its
logits guess token p+2. Each step it first catches up on the positions the target just verified,
fed with the target's hidden rows of that same step (no second pass over the prompt), then chains
k - 1 more drafts from its own outputs. Its layers keep K/V in the paged cache at the target's
block ids, as a draft model's do; positions that held rejected drafts are computed again at the
next catch-up. Drafts are the argmax (a point mass), so verification is lossless for every request.
An EAGLE-3 head may also draft the tokens of a request's context that lie outside its draft
vocabulary (`draft_context_tokens`, spec_decode/context_tokens.py). The heads load in the Hub's
layouts (spec_decode/eagle_head.py, eagle3.py, mtp.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.forward_context import set_forward_context
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.sampler import greedy_argmax
from pagedllm.model_executor.models.utils import DecoderStack
from pagedllm.spec_decode.context_tokens import context_tokens
from pagedllm.spec_decode.draft_model import InputBuilder, KVDrafter
from pagedllm.spec_decode.eagle3 import aux_layer_ids, load_eagle3_head
from pagedllm.spec_decode.eagle_head import load_eagle_head
from pagedllm.spec_decode.mtp import load_mtp_head

EMBED_CACHE_ROWS = 2048  # embedding rows the proposer keeps (5 MB at hidden 640 in float32)
MAX_CACHED_PASS = 16  # passes of more tokens (a prompt chunk's catch-up) look theirs up directly


def _trunk(target: nn.Module) -> DecoderStack:
    """The target's decoder stack (a vision-language model's language model's)."""
    get_lm = getattr(target, "get_language_model", None)
    lm = get_lm() if get_lm is not None else target
    trunk = getattr(lm, getattr(lm, "trunk_name", "model"), None)
    if not isinstance(trunk, DecoderStack) or type(trunk).forward is not DecoderStack.forward:
        raise ValueError(f"EAGLE-3 reads the target's layers; {type(target).__name__} is not a decoder stack")
    return trunk


class EagleProposer(KVDrafter):
    """EAGLE (`method` "eagle": the target's final hidden states, its LM head), EAGLE-3
    ("eagle3": the residual stream at three target layers, the head's own draft vocabulary) and
    MTP ("mtp": as EAGLE, with the target's own MTP layer for the head, spec_decode/mtp.py)."""

    def __init__(self, config: EngineConfig, target: nn.Module, device: torch.device,
                 prepare_inputs: InputBuilder) -> None:
        super().__init__(config, device, prepare_inputs)
        spec = config.speculative_config
        dtype = config.model_config.dtype
        self.target = target
        self.trunk: DecoderStack | None = None
        if spec.method == "eagle3":
            self.trunk = _trunk(target)
            aux = aux_layer_ids(spec.eagle_config, config.model_config.text_config.num_hidden_layers)
            quantized = config.model_config.quantization if device.type == "cpu" else None
            self.head = load_eagle3_head(spec.heads_path, spec.eagle_config, len(aux), dtype, device,
                                         self.max_model_len, quantized)
            self.trunk.aux_hidden_layers = aux  # its forward (or decode plan) keeps their inputs
            self.draft_logits = self.head.draft_logits
            self.d2t: list[int] | None = self.head.d2t.tolist()  # a draft's offset to its target id, per row
        else:
            if spec.method == "mtp":
                self.head = load_mtp_head(spec.heads_path, spec.eagle_config, dtype, device, self.max_model_len)
            else:
                self.head = load_eagle_head(spec.heads_path, spec.eagle_config, dtype, device, self.max_model_len)
            self.draft_logits, self.d2t = target.compute_logits, None
        self.confidence_threshold = spec.draft_confidence_threshold
        self.embed = self.head.embed_tokens or getattr(getattr(target, "model", None), "embed_tokens", None)
        if self.embed is None:
            raise ValueError(f"the EAGLE head at {spec.heads_path!r} has no embed_tokens.weight and the target "
                             f"({type(target).__name__}) has no model.embed_tokens to share")
        # Rows of the embedding by token id (`_embed`); none under tensor parallelism, whose
        # lookup is a collective every rank takes part in.
        self.embed_rows: dict[int, torch.Tensor] | None = {} if getattr(self.embed, "tp_size", 1) == 1 else None
        self.attn_layers = [m for m in self.head.modules() if isinstance(m, Attention)]
        self.context = context_tokens(spec, self.d2t, self._embed) if self.d2t is not None else None
        # The worker's replay of the head's layer as bound kernel calls (worker/eagle_plan.py):
        # called with (embeds, hidden, query lengths, starts, block ids, block size): the head's
        # rows, or None for its modules; its `draft_logits(rows)` likewise, and `normed` the LM head's
        # input rows of that call.
        self.layer_plan: Callable[..., torch.Tensor | None] | None = None

    def draft(self, out: torch.Tensor, req_ids: list[str] | None = None) -> tuple[list[int], list[float] | None]:
        """Each row's draft (a target token id), and with a confidence threshold the head's
        probability of it (softmax over the head's logits, and the context tokens' where the
        head drafts those: `req_ids` names each row's request)."""
        plan = self.layer_plan
        logits = None if plan is None else plan.draft_logits(out)
        normed = None if logits is None else plan.normed  # the LM head's input, where the plan ran it
        if logits is None:
            logits = self.draft_logits(out)
        best = greedy_argmax(logits)
        ids = best.tolist()
        if self.d2t is not None:  # the head's draft-vocabulary ids as the target's
            ids = [i + self.d2t[i] for i in ids]
        conf = None
        if self.confidence_threshold:
            # One softmax kernel: logsumexp's ~10 ops took a third of a draft's time on CPU.
            conf = torch.softmax(logits.float(), dim=-1).gather(1, best.unsqueeze(1)).squeeze(1).tolist()
        if self.context is not None and req_ids is not None:
            top = logits.gather(1, best.unsqueeze(1)).view(-1).tolist()
            self.context.pick(req_ids, self.head.norm(out) if normed is None else normed, top, ids, conf)
        return ids, conf

    def drop(self, req_ids: Iterable[str]) -> None:
        if self.context is not None:
            self.context.drop(req_ids)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of the step just run that the head reads: the target's final hidden states,
        or (EAGLE-3) its layers' inputs side by side."""
        return hidden if self.trunk is None else self.trunk.aux_hidden_states

    def _embed(self, tokens: list[int]) -> torch.Tensor:
        """The embeddings of a pass's tokens. A chained pass feeds back a few hundred distinct
        tokens over a whole answer, so a short pass takes each row from a small cache of rows
        looked up before (a lookup costs ~0.1 ms of small calls for its one or two rows)."""
        if self.embed_rows is None or len(tokens) > MAX_CACHED_PASS:
            return self.embed(torch.tensor(tokens, device=self.device))
        rows = self.embed_rows
        missing = [t for t in dict.fromkeys(tokens) if t not in rows]
        if missing:
            if len(rows) + len(missing) > EMBED_CACHE_ROWS:
                rows.clear()
            rows.update(zip(missing, self.embed(torch.tensor(missing, device=self.device)).unbind(0)))
        return torch.stack([rows[t] for t in tokens])

    def _run(self, tokens: list[list[int]], starts: list[int], block_ids: list[Any],
             hidden: torch.Tensor) -> torch.Tensor:
        """The head's rows for each request's `tokens` after its `starts` cached positions, fed
        `hidden` (the target's rows or the head's own): its layer's bound kernel calls where they
        take the pass, else its modules on the step's inputs."""
        embeds = self._embed([t for toks in tokens for t in toks])
        plan = self.layer_plan
        if plan is not None:
            out = plan(embeds, hidden, [len(t) for t in tokens], starts, block_ids, self.block_size)
            if out is not None:
                return out
        step = self.prepare_inputs(tokens, starts, block_ids, self.block_size, self.device)
        with set_forward_context(step.attn_metadata):
            return self.head(embeds, hidden, step.positions)

    @torch.inference_mode()
    def propose(self, reqs: list[Any], new_tokens: list[list[int] | None], hidden: torch.Tensor,
                cu_end: np.ndarray, max_drafts: int | None = None) -> list[list[int] | None]:
        """Drafts for the requests that sampled (`new_tokens[i]`: the tokens step i emitted, its
        accepted drafts then the bonus token), from the target's `hidden` rows of this step; at
        most `max_drafts` (0: only the catch-up, which later drafts need)."""
        # 1. Catch up: each position the target computed and kept, with the token that follows it.
        tokens, rows = [], []
        for r, new, end in zip(reqs, new_tokens, cu_end):
            first = int(end) - r.num_scheduled
            if new is None:  # a prompt chunk: the next token is the prompt's own
                tokens.append(r.state.token_slice(r.start_pos + 1, r.end + 1))
            else:
                tokens.append(r.state.token_slice(r.start_pos + 1, r.end) + list(new))
            rows.append(np.arange(first, first + len(tokens[-1])))
        out = self._run(tokens, [r.start_pos for r in reqs], [r.block_ids for r in reqs],
                        hidden[torch.from_numpy(np.concatenate(rows)).to(self.device)])
        last_rows = np.cumsum([len(t) for t in tokens]) - 1  # each request's last row in `out`

        # 2. Chain: draft j + 1 from the row fed with draft j at the next position.
        due = [i for i, new in enumerate(new_tokens) if new is not None]
        seq_lens = [reqs[i].end + len(new_tokens[i]) for i in due]  # known tokens incl. the bonus
        budget = [self.budget(len(reqs[i].block_ids), t, max_drafts) for i, t in zip(due, seq_lens)]
        proposals: list[list[int] | None] = [None] * len(reqs)
        live = [a for a, b in enumerate(budget) if b > 0]  # indices into `due`
        if not live:
            return proposals
        feats = out[torch.from_numpy(last_rows[[due[a] for a in live]]).to(self.device)]
        drafts: dict[int, list[int]] = {a: [] for a in live}
        if self.context is not None:
            for a in live:
                self.context.update(reqs[due[a]], new_tokens[due[a]])
        chance = dict.fromkeys(live, 1.0)  # the head's probability that every draft so far is right
        for j in range(max(budget)):
            toks, conf = self.draft(feats, None if self.context is None else [reqs[due[a]].req_id for a in live])
            for n, (a, tok) in enumerate(zip(live, toks)):
                if conf is not None:
                    chance[a] *= conf[n]
                    if chance[a] < self.confidence_threshold:  # not worth its row: the chain ends here
                        budget[a] = len(drafts[a])
                        continue
                drafts[a].append(tok)
            keep = [n for n, a in enumerate(live) if len(drafts[a]) < budget[a]]
            if not keep:
                break
            live = [live[n] for n in keep]
            feats = self._run([[drafts[a][-1]] for a in live], [seq_lens[a] - 1 + j for a in live],
                              [reqs[due[a]].block_ids for a in live], feats[torch.tensor(keep, device=self.device)])
        for a, d in drafts.items():
            proposals[due[a]] = d
        return proposals
