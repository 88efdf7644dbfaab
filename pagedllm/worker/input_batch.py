"""The worker's persistent batch (vLLM's InputBatch), kept up to date from the step messages: a
request arrives whole once (`NewRequestData`), then only as diffs (`CachedRequestData`), and is
dropped when it finishes or is preempted.

Each request owns a row of preallocated arrays: its tokens (prompt, output, then the drafts the
step verifies), its block table, and its sampling parameters, written when they change. A step's
token ids, positions and block tables are then gathers over rows, and its sampling parameters
slices, instead of tensors rebuilt from every request's lists.

Every rank holds the same states, so every rank builds the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.core.sched_output import NewRequestData, SchedulerOutput
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.protocol import MultiModalFeature
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.step_inputs import StepInputs, TokenLayout, build_step, token_layout


@dataclass(slots=True, eq=False)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # tokens with K/V in the cache before this step
    output_token_ids: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None
    row: int = -1  # its row in the InputBatch's arrays
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # its images, in prompt order
    # M-RoPE (Qwen2-VL): the prompt's [3, L] rotary positions, and the shift of every later token.
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two lists."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


@dataclass(slots=True, eq=False)
class StepRow:
    """One request's part of one step, fixed when the step is built: with steps in flight
    (pipeline parallel) the next message may move the request's state on before this one samples."""

    state: CachedRequestState
    start_pos: int  # tokens whose K/V the cache holds before this step
    end: int  # the known tokens this step computes end here; the drafts follow
    spec_token_ids: list[int]  # drafts to verify
    sample: bool  # does this step reach the end of the known tokens?
    output_token_ids: list[int]  # the history the sampler sees (a draft's row: with the drafts before it)

    @property
    def req_id(self) -> str:
        return self.state.req_id

    @property
    def row(self) -> int:
        return self.state.row

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.state.prompt_token_ids

    @property
    def sampling_params(self) -> SamplingParams:
        return self.state.sampling_params

    @property
    def pooling_params(self) -> PoolingParams | None:
        return self.state.pooling_params

    @property
    def lora_request(self) -> LoRARequest | None:
        return self.state.lora_request

    @property
    def token_type_ids(self) -> list[int] | None:
        return self.state.token_type_ids

    @property
    def block_ids(self) -> list[int]:
        return self.state.block_ids

    @property
    def num_tokens(self) -> int:
        return self.state.num_tokens

    @property
    def num_scheduled(self) -> int:
        return self.end - self.start_pos + len(self.spec_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes, drafts last."""
        return self.state.token_slice(self.start_pos, self.end) + self.spec_token_ids


class InputBatch:
    def __init__(self, max_num_reqs: int = 8, max_model_len: int = 256, max_num_blocks: int = 16,
                 mrope_positions_fn: Callable | None = None) -> None:
        """`mrope_positions_fn(prompt_token_ids, mm_features) -> ([3, L] positions, delta)`: a
        model with multimodal RoPE (its `get_mrope_input_positions`); the steps' rotary
        positions then come from it."""
        self.requests: dict[str, CachedRequestState] = {}
        self.mrope_positions_fn = mrope_positions_fn
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks), np.int64)
        # Sampling parameters, per row, written once when the request arrives.
        self.temperature = np.ones(max_num_reqs, np.float32)
        self.greedy = np.zeros(max_num_reqs, bool)
        self.top_k = np.zeros(max_num_reqs, np.int64)
        self.top_p = np.ones(max_num_reqs, np.float32)
        self.min_p = np.zeros(max_num_reqs, np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, np.int64)  # -1: none asked
        self.seeded = np.zeros(max_num_reqs, bool)
        self.reads_history = np.zeros(max_num_reqs, bool)  # penalties or logits processors
        self.has_masks = np.zeros(max_num_reqs, bool)  # bias, allowed ids, min_tokens, bad words

    def update_states(self, sched: SchedulerOutput) -> list[StepRow]:
        """Apply one step message; returns the step's requests in row order."""
        for req_id in sched.finished_req_ids:
            self._remove(req_id)
        for req_id in sched.preempted_req_ids:
            self._remove(req_id)
        for new in sched.scheduled_new_reqs:
            self._add(new)
        cached = sched.scheduled_cached_reqs
        appended = []
        for req_id, tokens, blocks, computed in zip(cached.req_ids, cached.new_token_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            state = self.requests[req_id]
            if tokens:
                appended.append((state, tokens))
            if blocks:
                self._write_blocks(state, blocks)
            state.num_computed_tokens = computed
        if appended:
            self.append_tokens(appended)
        rows = []
        drafts = sched.scheduled_spec_decode_tokens
        for req_id, n in sched.num_scheduled_tokens.items():
            state = self.requests[req_id]
            spec = drafts.get(req_id, [])
            start = state.num_computed_tokens
            end = start + n - len(spec)
            if spec:
                self._write_tokens(state.row, end, spec)
            rows.append(StepRow(state, start, end, spec, end >= state.num_tokens, state.output_token_ids))
        return rows

    def append_tokens(self, appended: Sequence[tuple[CachedRequestState, Sequence[int]]]) -> None:
        """New output tokens of requests: their lists, and their rows in one scatter."""
        rows: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        for state, tokens in appended:
            n = state.num_tokens
            state.output_token_ids.extend(tokens)
            rows += [state.row] * len(tokens)
            cols += range(n, n + len(tokens))
            values += tokens
        end = max(cols) + 1
        if end > self.token_ids.shape[1]:
            self.token_ids = _widen(self.token_ids, end)
        self.token_ids[rows, cols] = values

    def prepare_inputs(self, rows: Sequence[StepRow], block_size: int, device: torch.device,
                       mm_prefix_lm: bool = False) -> StepInputs:
        """The step's flat inputs, gathered from the rows' arrays. `mm_prefix_lm`: the image
        spans each row's tokens reach attend both ways (`PrefillSegment.bidirectional`)."""
        num = len(rows)
        idx = np.fromiter((r.state.row for r in rows), np.int64, num)
        starts = np.fromiter((r.start_pos for r in rows), np.int64, num)
        query_lens = np.fromiter((r.num_scheduled for r in rows), np.int64, num)
        layout = token_layout(query_lens, starts)
        input_ids = self.token_ids[idx[layout.req_of_token], layout.positions].astype(np.int64)
        max_blocks = int(-(-(starts + query_lens).max() // block_size))
        spans = None
        if mm_prefix_lm:
            spans = [[(f.offset, f.offset + f.length) for f in r.state.mm_features
                      if f.offset < r.start_pos + r.num_scheduled and f.offset + f.length > r.start_pos] for r in rows]
        step = build_step(input_ids, layout, self.block_table[idx, :max_blocks], block_size, device, spans)
        if self.mrope_positions_fn is not None:
            step.positions = self._mrope_positions(rows, layout).to(device)
        return step

    @staticmethod
    def _mrope_positions(rows: Sequence[StepRow], layout: TokenLayout) -> torch.Tensor:
        """The step's rotary positions: [3, T] where an image token is among them, else [T]
        (three equal streams are plain RoPE, for the fused kernel and the decode plans)."""
        out = np.empty((3, len(layout.positions)), np.int64)
        for k, r in enumerate(rows):
            a, b = int(layout.cu_start[k]), int(layout.cu_end[k])
            pos = layout.positions[a:b]
            prompt = r.state.mrope_positions
            out[:, a:b] = pos + r.state.mrope_delta
            in_prompt = pos < prompt.shape[1]
            if in_prompt.any():
                out[:, a:b][:, in_prompt] = prompt[:, pos[in_prompt]]
        if (out[0] == out[1]).all() and (out[0] == out[2]).all():
            return torch.from_numpy(out[0].copy())
        return torch.from_numpy(out)

    # ---- rows -------------------------------------------------------------
    def _add(self, new: NewRequestData) -> None:
        if not self._free_rows:
            self._grow_rows()
        state = CachedRequestState(new.req_id, new.prompt_token_ids, new.sampling_params, [],
                                   new.num_computed_tokens, [], new.pooling_params, new.token_type_ids,
                                   new.lora_request, self._free_rows.pop(), new.mm_features)
        self.requests[new.req_id] = state
        if self.mrope_positions_fn is not None:
            state.mrope_positions, state.mrope_delta = self.mrope_positions_fn(new.prompt_token_ids, new.mm_features)
        row = state.row
        self._write_tokens(row, 0, new.prompt_token_ids)
        if new.output_token_ids:  # resumed after preemption
            self.append_tokens([(state, new.output_token_ids)])
        self._write_blocks(state, new.block_ids)
        self._write_params(row, new.sampling_params)

    def _remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:  # a gathered table pads a shorter row with zeros, never a former request's ids
            self.block_table[state.row, : len(state.block_ids)] = 0
            self._free_rows.append(state.row)

    def _write_tokens(self, row: int, start: int, tokens: Sequence[int]) -> None:
        end = start + len(tokens)
        if end > self.token_ids.shape[1]:
            self.token_ids = _widen(self.token_ids, end)
        self.token_ids[row, start:end] = tokens

    def _write_blocks(self, state: CachedRequestState, blocks: Sequence[int]) -> None:
        n = len(state.block_ids)
        state.block_ids.extend(blocks)
        if n + len(blocks) > self.block_table.shape[1]:
            self.block_table = _widen(self.block_table, n + len(blocks))
        self.block_table[state.row, n : n + len(blocks)] = blocks

    def _write_params(self, row: int, p: SamplingParams | None) -> None:
        if p is None:  # a pooling request: never sampled
            p = _POOLING
        self.greedy[row] = p.greedy
        self.temperature[row] = 1.0 if p.greedy else p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.seeded[row] = p.seed is not None and not p.greedy
        self.reads_history[row] = p.needs_output_history
        self.has_masks[row] = bool(p.allowed_token_ids is not None or p.logit_bias or p.min_tokens
                                   or p.bad_words_token_ids)

    def _grow_rows(self) -> None:
        old = len(self.greedy)
        for name in ("token_ids", "block_table", "temperature", "greedy", "top_k",
                     "top_p", "min_p", "num_logprobs", "seeded", "reads_history", "has_masks"):
            a = getattr(self, name)
            grown = np.zeros((2 * old,) + a.shape[1:], a.dtype)
            grown[:old] = a
            setattr(self, name, grown)
        self._free_rows = list(range(2 * old - 1, old - 1, -1))


_POOLING = SamplingParams(temperature=0)


def _widen(a: np.ndarray, cols: int) -> np.ndarray:
    grown = np.zeros((a.shape[0], max(cols, 2 * a.shape[1])), a.dtype)
    grown[:, : a.shape[1]] = a
    return grown
