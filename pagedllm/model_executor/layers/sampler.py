"""Batched sampling: one pass over the whole batch, per-request parameters as tensors.

Order (as vLLM): raw logprobs → logits processors → allowed tokens / bad words /
min_tokens / logit_bias → penalties → greedy argmax → temperature → min_p →
top-k / top-p → random draw. Only the rows that use a feature pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.model_executor.custom_op import CustomFn
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers.penalties import apply_penalties


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor | None  # [B] float32 (1.0 on greedy rows); None if all greedy
    top_k: torch.Tensor | None  # [B] int64, 0 where off; None if no row uses it
    top_p: torch.Tensor | None  # [B] float32, 1.0 where off; None if no row uses it
    greedy: torch.Tensor | None  # [B] bool
    all_greedy: bool
    # row → generator, for requests with a seed: their draws do not depend on the batch.
    generators: dict[int, torch.Generator]
    min_p: torch.Tensor | None = None  # [B] float32, 0 where off
    max_num_logprobs: int | None = None  # top-k logprobs to return (None: none requested)
    # row → additive [V] bias that never changes (allowed_token_ids as -inf elsewhere, logit_bias)
    static_bias: dict[int, torch.Tensor] = field(default_factory=dict)
    # row → token ids banned at this step (bad words, stop tokens before min_tokens)
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Penalties: rows that use any, with their token histories.
    penalty_rows: list[int] = field(default_factory=list)
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    presence_penalties: list[float] = field(default_factory=list)
    frequency_penalties: list[float] = field(default_factory=list)
    repetition_penalties: list[float] = field(default_factory=list)
    # row → (callables, prompt ids, output ids)
    logits_processors: dict[int, tuple[list, list[int], list[int]]] = field(default_factory=dict)
    # Structured outputs: [R, vocab/32] int32 bitmask of allowed tokens for the R rows in
    # grammar_rows (the other rows are free).
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B]
    # When logprobs were requested: [B, 1 + k] ids and logprobs (sampled token first), [B] ranks.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for unseeded random rows

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] in the model dtype."""
        logits, raw_logprobs = self.apply_constraints(logits, md)
        sampled = self.sample(logits, md)
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        return SamplerOutput(sampled, *gather_logprobs(raw_logprobs, md.max_num_logprobs, sampled))

    def apply_constraints(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Grammar, processors, masks, bias, penalties → (processed logits, raw logprobs or None)."""
        # Without logprobs, masks or penalties the logits stay in the model dtype: argmax and
        # top-k need no float32 copy of [B, vocab] (bf16 → fp32 is exact, so results agree).
        if not (md.max_num_logprobs is not None or md.static_bias or md.banned_token_ids or md.penalty_rows
                or md.logits_processors or md.grammar_bitmask is not None):
            return logits, None
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        if md.grammar_bitmask is not None:
            apply_token_bitmask(logits, md.grammar_bitmask, md.grammar_rows)
        logits = self._apply_logits_processors(logits, md)
        for row, bias in md.static_bias.items():
            logits[row] += bias
        for row, banned in md.banned_token_ids.items():
            logits[row, banned] = float("-inf")
        if md.penalty_rows:
            rows = torch.tensor(md.penalty_rows, device=logits.device)
            logits[rows] = apply_penalties(
                logits[rows], md.prompt_token_ids, md.output_token_ids,
                md.presence_penalties, md.frequency_penalties, md.repetition_penalties,
            )
        return logits, raw_logprobs

    def _apply_logits_processors(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        for row, (procs, prompt_ids, output_ids) in md.logits_processors.items():
            row_logits = logits[row]
            for proc in procs:
                try:
                    row_logits = proc(prompt_ids, output_ids, row_logits)
                except TypeError:
                    row_logits = proc(output_ids, row_logits)
            logits[row] = row_logits
        return logits

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.all_greedy:
            return greedy_argmax(logits)
        num_rows = logits.shape[0]
        out = torch.empty(num_rows, dtype=torch.long, device=logits.device)
        top_k = md.top_k if md.top_k is not None else torch.zeros(num_rows, dtype=torch.long, device=logits.device)
        random_rows = ~md.greedy
        # Top-p alone; min-p renormalises before the nucleus is taken, so its rows take the full path.
        nucleus = random_rows & (top_k == 0) & (md.top_p < 1.0) if md.top_p is not None else torch.zeros_like(md.greedy)
        if md.min_p is not None:
            nucleus &= md.min_p <= 0.0
        # The path depends only on the row's own parameters, so a seeded row draws the
        # same numbers whatever else is in the batch.
        paths = (
            (md.greedy, None),
            (random_rows & (top_k > 0), self._sample_top_k),
            (nucleus, self._sample_top_p),
            (random_rows & (top_k == 0) & ~nucleus, self._sample_full),
        )
        for rows, sample in paths:
            idx = torch.nonzero(rows).flatten()
            if not idx.numel():
                continue
            sub = logits if idx.numel() == num_rows else logits[idx]  # no [B, vocab] copy when all rows agree
            if sample is None:
                out[idx] = greedy_argmax(sub)
                continue
            gens = {j: md.generators[int(r)] for j, r in enumerate(idx.tolist()) if int(r) in md.generators}
            out[idx] = sample(sub, idx, md, gens)
        return out

    def _sample_top_k(self, logits: torch.Tensor, idx: torch.Tensor, md: SamplingMetadata, gens) -> torch.Tensor:
        """Rows with top-k: everything (min_p, top_p, the draw) happens on the k candidates,
        never sorting or normalising the whole vocabulary."""
        k = md.top_k[idx]
        widths = k.tolist()  # one device sync for the widths and their maximum
        vals, ids = top_candidates(logits, min(max(widths), logits.shape[1]))  # order is scale-free
        vals = vals.float() / md.temperature[idx].unsqueeze(1)
        vals = vals.masked_fill(torch.arange(vals.shape[1], device=vals.device) >= k.unsqueeze(1), float("-inf"))
        if md.min_p is not None:  # p / p_max does not depend on the normalisation
            vals = vals.masked_fill(vals - vals[:, :1] < md.min_p[idx].log().unsqueeze(1), float("-inf"))
        probs = vals.softmax(dim=-1)
        if md.top_p is not None:
            mass_above = probs.cumsum(dim=-1) - probs
            probs = probs.masked_fill(mass_above >= md.top_p[idx].unsqueeze(1), 0.0)
        choice = self._random_draw(probs, gens)
        return ids.gather(1, choice.unsqueeze(1)).squeeze(1)

    def _sample_top_p(self, logits: torch.Tensor, idx: torch.Tensor, md: SamplingMetadata, gens) -> torch.Tensor:
        """Rows with top-p alone: each row's nucleus looked for among its `_TOP_P_WIDTHS[0]`
        likeliest tokens, their probabilities taken against the whole row's normaliser (one
        pass), and the draw made among them; a row whose top-p mass lies wider takes the full
        path (`sampling_probs`). No [rows, vocab] softmax, clone or draw where the nucleus is
        narrow, as it is for most rows of a chat model. Which path a row takes depends on its
        own logits alone."""
        temp = md.temperature[idx].unsqueeze(1)
        vals, ids = top_candidates(logits, min(_TOP_P_WIDTHS[0], logits.shape[1]))
        # As sampling_probs scales them; the row's log normaliser over its whole vocabulary.
        norm = torch.logsumexp(logits.float() / temp, dim=-1, keepdim=True)
        probs = (vals.float() / temp - norm).exp()
        keep, found = _nucleus(probs, md.top_p[idx])
        out = torch.empty(len(idx), dtype=torch.long, device=logits.device)
        for rows, narrow in ((torch.nonzero(found).flatten(), True), (torch.nonzero(~found).flatten(), False)):
            if not rows.numel():
                continue
            own = {j: gens[int(r)] for j, r in enumerate(rows.tolist()) if int(r) in gens}
            if narrow:
                choice = self._random_draw(probs[rows].masked_fill(~keep[rows], 0.0), own)
                out[rows] = ids[rows].gather(1, choice.unsqueeze(1)).squeeze(1)
            else:
                out[rows] = self._sample_full(logits[rows], idx[rows], md, own)
        return out

    def _sample_full(self, logits: torch.Tensor, idx: torch.Tensor, md: SamplingMetadata, gens) -> torch.Tensor:
        return self._random_draw(sampling_probs(logits, md, idx), gens)

    def _random_draw(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        return random_draw(probs, generators, self.generator)


def random_draw(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default: torch.Generator | None,
) -> torch.Tensor:
    """One draw per row of `probs` (>= 0, normalised or not; zeros are never drawn), by inverse
    CDF: one uniform number a row, the first index whose running sum passes it. Rows in
    `generators` take theirs from their own (seeded) generator, one number a step whatever
    else is in the batch; the rest share `default`. Every generator is on `probs`' device. A row
    with NaNs gets its first NaN, as argmax would give it."""
    u = torch.empty(probs.shape[0], dtype=torch.float64, device=probs.device)
    if len(generators) < probs.shape[0]:
        u.uniform_(generator=default)
    for row, gen in generators.items():
        u[row : row + 1].uniform_(generator=gen)
    choice = _inverse_cdf(probs, u)
    bad = choice < 0
    if bool(bad.any()):
        choice[bad] = greedy_argmax(probs[bad])
    return choice


def _inverse_cdf_native(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Running sums in float64, then the first index where one passes u times the row's sum
    (-1 where that sum is not a positive finite number)."""
    cum = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cum[:, -1:]
    choice = torch.searchsorted(cum, u.unsqueeze(1) * total, right=True).squeeze(1)
    ok = (total.squeeze(1) > 0) & total.squeeze(1).isfinite()
    return torch.where(ok, choice.clamp_(max=probs.shape[1] - 1), -1)


_inverse_cdf = CustomFn(_inverse_cdf_native, cpu=lambda probs, u: cpu_kernels.sample_from_probs(probs, u))


_ARGMAX_CHUNK = 1024
_TOP_P_WIDTHS = (256, 4096)  # candidates a row's top-p nucleus is looked for in before a full sort


def _argmax_native(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum's index of each row, as `max(dim).indices` gives it (a NaN wins).
    On CPU one pass of pagedllm's C kernel. On a GPU `argmax`: one reduction kernel, where the
    two passes below are five launches. Otherwise two passes: the maximum of each chunk
    of the vocabulary (`amax`, vectorised), then the index within the first chunk holding the
    row's maximum; over a [64, 262144] bf16 head ~3x faster than `max(dim)`, and `argmax` over
    bf16 is slower still (it is not vectorised on CPU)."""
    vocab = logits.shape[1]
    n = vocab // _ARGMAX_CHUNK
    if n < 4:
        return logits.max(dim=-1).indices
    chunk_max = logits[:, : n * _ARGMAX_CHUNK].unflatten(1, (n, _ARGMAX_CHUNK)).amax(dim=-1)
    if vocab > n * _ARGMAX_CHUNK:  # the tail is one more, shorter chunk
        chunk_max = torch.cat([chunk_max, logits[:, n * _ARGMAX_CHUNK :].amax(dim=-1, keepdim=True)], dim=1)
    start = chunk_max.max(dim=-1).indices * _ARGMAX_CHUNK
    # A short tail chunk repeats its last column: repeats come after it, so the first maximum holds.
    cols = (start[:, None] + torch.arange(_ARGMAX_CHUNK, device=logits.device)).clamp_(max=vocab - 1)
    return start + logits.gather(1, cols).max(dim=-1).indices


greedy_argmax = CustomFn(_argmax_native, cpu=lambda logits: cpu_kernels.argmax_rows(logits),
                         cuda=lambda logits: logits.argmax(dim=-1))


def _top_k_native(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k best indices, in any order (ties: any valid choice)."""
    return logits.topk(k, dim=-1).indices


# Each row's k best indices in any order: on CPU one pass of a heap (earlier index first among
# equal values), 20-40x faster than torch.topk's partial sort over [64, 262144] logits.
top_k_indices = CustomFn(_top_k_native, cpu=lambda logits, k: cpu_kernels.topk_indices(logits, k))


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest logits, sorted descending (among equal values, the order
    `top_k_indices` gives them), and their ids."""
    ids = top_k_indices(logits, k)
    vals, order = logits.gather(1, ids).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order)


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata, rows: torch.Tensor) -> torch.Tensor:
    """The distribution a random row is drawn from, given its processed logits ([len(rows), V]) and
    metadata rows `rows`: temperature, top-k, min-p, top-p, in that order; [len(rows), V] float32.
    Speculative decoding verifies drafts against the same distribution."""
    x = logits.float() / md.temperature[rows].unsqueeze(1)
    top_k = md.top_k[rows] if md.top_k is not None else None
    if top_k is not None and bool((top_k > 0).any()):
        x = apply_top_k_top_p(x, top_k, None)
    if md.min_p is not None:  # p / p_max >= min_p does not depend on the normalisation
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * md.min_p[rows].unsqueeze(1), float("-inf"))
    top_p = md.top_p[rows] if md.top_p is not None else None
    if top_p is not None and bool((top_p < 1.0).any()):
        x = apply_top_k_top_p(x, None, top_p)
    return x.softmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, k: int, token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k logprobs plus the chosen token's logprob and rank (1 = most likely)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if k > 0:
        top_vals, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
        vals = torch.cat([chosen, top_vals], dim=1)
    else:
        ids, vals = token_ids.unsqueeze(1), chosen
    return ids, vals, ranks


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus to -inf.

    top_k rows of 0 and top_p rows of 1.0 are off.
    """
    if top_k is not None:
        # A threshold from topk() avoids sorting the whole vocabulary for top-k.
        k_on = top_k > 0
        max_k = int(top_k.max())
        kth = logits.topk(max_k, dim=-1).values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
        kth = kth.masked_fill(~k_on.unsqueeze(1), float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is None:
        return logits
    return _apply_top_p(logits, top_p)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's nucleus: its most likely tokens up to the first whose running mass (from the
    top) reaches top_p, the top token always; -inf elsewhere. Rows at top_p 1.0 keep every token."""
    out = logits.clone()
    pending = torch.nonzero(top_p < 1.0).flatten()
    if pending.numel():
        rows = logits[pending]
        keep = nucleus_keep(rows.softmax(dim=-1), top_p[pending])
        out[pending] = rows.masked_fill(~keep, float("-inf"))
    return out


def _nucleus_keep_native(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens are in each row's top-p nucleus ([rows, vocab] bool), from its probabilities.
    A token is kept while the mass above it is under top_p, so where a row's top `width` tokens
    hold top_p of its mass the nucleus lies among them: it is looked for in the top 256, then
    4,096 (`topk`), and only a row whose mass is spread wider has its whole vocabulary sorted.
    Each row's path depends on its own values alone, and every path keeps the same set. (On
    CPU the C kernel finds it in two passes with no sort: `cpu_kernels.top_p_keep`.)"""
    keep = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device)
    pending = torch.arange(probs.shape[0], device=probs.device)
    for width in _TOP_P_WIDTHS:
        if not pending.numel() or width >= probs.shape[1]:
            break
        vals, ids = probs.topk(width, dim=-1)  # sorted, descending
        kept, found = _nucleus(vals, top_p[pending])
        keep[pending[found].unsqueeze(1), ids[found]] = kept[found]
        pending, probs = pending[~found], probs[~found]
    if pending.numel():
        vals, ids = probs.sort(dim=-1, descending=True)
        kept, _ = _nucleus(vals, top_p[pending])
        keep[pending.unsqueeze(1), ids] = kept
    return keep


nucleus_keep = CustomFn(_nucleus_keep_native, cpu=lambda probs, top_p: cpu_kernels.top_p_keep(probs, top_p))


def _nucleus(vals: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row's top probabilities `vals` (descending): which are in its top-p nucleus,
    and whether they reach top_p (so that every token after them is out). Running sums in
    float64: near top_p = 1 the tail's probabilities are far below float32's rounding of 1."""
    p = top_p.to(torch.float64).unsqueeze(1)
    cum = vals.cumsum(dim=-1, dtype=torch.float64)
    keep = cum - vals < p
    keep[:, 0] = True
    return keep, cum[:, -1] >= p.squeeze(1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (xgrammar's layout,
    little-endian bits in int32 words). On CPU the bits are unpacked by numpy and applied with
    one torch.where: 8x faster than xgrammar's CPU kernel on a 262k vocabulary."""
    num_rows, vocab = logits.shape
    if logits.device.type != "cpu":  # the Triton kernel, on the device
        from pagedllm.model_executor.layers.triton_ops.bitmask import apply_token_bitmask_inplace

        apply_token_bitmask_inplace(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
        return
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, count=vocab, bitorder="little")
    allowed = torch.from_numpy(bits.view(np.bool_))
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype)
    if rows == list(range(num_rows)):
        torch.where(allowed, logits, neg_inf, out=logits)
    else:
        index = torch.tensor(rows)
        logits[index] = torch.where(allowed, logits[index], neg_inf)
