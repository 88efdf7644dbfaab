"""The scheduler tests' fake engine: a scheduler on a small block pool, requests with distinct
prompts, and a Driver that runs schedule -> fake forward -> update_from_output, checking the
scheduler's invariants and a simulated paged KV cache every step.

Every step message goes through msgspec and into a worker's InputBatch (`WorkerView`), and the
checks read the requests as the worker rebuilt them from the diffs, so the scheduler tests also
prove that the messages are self-contained."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import msgspec

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch, StepRow

BS = 4
EOS = 2
FILLER = 500  # first token a request samples unless scripted; never EOS


def make_scheduler(
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    policy: str = "fcfs",
    prefix_caching: bool = True,
    long_prefill_token_threshold: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,
        ),
        CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
    )


def make_req(
    req_id: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time: float = 0.0,
    **params,
) -> Request:
    if isinstance(prompt, int):
        # Distinct tokens per request, so prefixes are only shared when a test wants it.
        base = 1000 * (sum(map(ord, req_id)) + 1)
        prompt = list(range(base, base + prompt))
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, **params),
        eos_token_ids=frozenset({EOS}),
        priority=priority,
        arrival_time=arrival_time,
    )


@dataclass
class StepView:
    """One step as a worker sees it: the decoded message and its requests, snapshotted."""

    message: SchedulerOutput
    scheduled: list[StepRow]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)


class WorkerView:
    """A worker's InputBatch fed with the msgspec encoding of each step message."""

    def __init__(self) -> None:
        self.batch = InputBatch()
        self.decoder = msgspec.msgpack.Decoder(SchedulerOutput)

    def apply(self, out: SchedulerOutput) -> StepView:
        message = self.decoder.decode(msgspec.msgpack.encode(out))
        rows = self.batch.update_states(message)
        snapshots = []
        for r in rows:
            state = replace(r.state, block_ids=list(r.block_ids), output_token_ids=list(r.state.output_token_ids))
            snapshots.append(replace(r, state=state, output_token_ids=state.output_token_ids))
        return StepView(message, snapshots)


class Driver:
    """Runs schedule -> fake forward -> update_from_output and checks invariants each step."""

    def __init__(self, sched: Scheduler, script: dict[str, list[int]] | None = None) -> None:
        self.sched = sched
        self.script = script or {}
        self.worker = WorkerView()
        self.outputs: list[StepView] = []
        self.finished: dict[str, Request] = {}
        self.kv_len: dict[str, int] = {}  # tokens the fake runner holds K/V for, per request
        # A simulated paged KV cache: (block_id, slot) -> the token prefix whose K/V it holds.
        self.kv_slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def next_token(self, req: Request) -> int:
        script = self.script.get(req.request_id)
        if script is not None:
            return script[req.num_output_tokens]
        return FILLER + req.num_output_tokens

    def step(self) -> StepView:
        sched = self.sched
        message = sched.schedule()
        out = self.worker.apply(message)
        cfg = sched.config
        assert out.total_num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        assert len({s.req_id for s in out.scheduled}) == len(out.scheduled)
        for rid in out.preempted_req_ids:
            self.kv_len.pop(rid, None)
        # The runner copies forked blocks (n > 1 samples) before the forward pass.
        for src, dst in out.block_copies:
            for slot in range(BS):
                self.kv_slots.pop((dst, slot), None)
                if (src, slot) in self.kv_slots:
                    self.kv_slots[dst, slot] = self.kv_slots[src, slot]
        copied = {dst for _, dst in out.block_copies}
        tokens = []
        for s in out.scheduled:
            req = sched.requests[s.req_id]
            assert s.token_ids, "a scheduled request gets at least one token"
            assert s.token_ids == req.all_token_ids[s.start_pos : s.start_pos + len(s.token_ids)]
            end = s.start_pos + len(s.token_ids)
            assert len(s.block_ids) * BS >= end
            if s.req_id in self.kv_len:
                # A continuing request resumes exactly where its K/V ends.
                assert s.start_pos == self.kv_len[s.req_id]
            else:
                # A (re)started request begins at 0, after whole prefix-cached blocks, or in a
                # block copied for it this step.
                assert s.start_pos % BS == 0 or s.block_ids[s.start_pos // BS] in copied
                assert s.start_pos < req.num_tokens
            self.kv_len[s.req_id] = end
            # Everything before start_pos (computed earlier or a prefix-cache hit) must really
            # be in the request's blocks; then this step writes its own tokens.
            for pos in range(s.start_pos):
                slot = (s.block_ids[pos // BS], pos % BS)
                assert self.kv_slots.get(slot) == tuple(req.all_token_ids[: pos + 1]), (
                    f"{s.req_id} reuses position {pos} whose K/V was never written"
                )
            for pos in range(s.start_pos, end):
                self.kv_slots[(s.block_ids[pos // BS], pos % BS)] = tuple(req.all_token_ids[: pos + 1])
            assert s.sample == (end == req.num_tokens)
            tokens.append([self.next_token(req)] if s.sample else None)
        runner = ModelRunnerOutput([s.req_id for s in out.scheduled], tokens)
        by_id = {s.req_id: sched.requests[s.req_id] for s in out.scheduled}
        outputs = sched.update_from_output(message, runner)
        finished = [by_id[o.request_id] for o in outputs if o.finish_reason is not None]
        for req in finished:
            assert req.is_finished()
            self.finished[req.request_id] = req
            self.kv_len.pop(req.request_id)
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests(), "requests did not finish"
        assert_all_blocks_free(self.sched)

    def scheduled(self, step: int) -> dict[str, int]:
        return {s.req_id: len(s.token_ids) for s in self.outputs[step].scheduled}


def assert_all_blocks_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.block_pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.req_to_blocks == {} or all(not v for v in kv.req_to_blocks.values())
