"""V1-style scheduler: every request's num_computed_tokens catches up to its num_tokens.

There is no prefill or decode phase. Each step hands out a token budget, running
requests first (so decodes never starve), then waiting ones; a prompt that does
not fit the budget is chunked. When blocks run out, a running request is
preempted (its blocks freed, to be recomputed later).

The samples of one n / best_of request are admitted together: the first computes the prompt
while the others wait (`KVCacheManager.waits_for_sibling`), then every sibling that fits
shares its prompt's blocks and computes only its last prompt token.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.encoder_cache_manager import EncoderCacheManager
from pagedllm.core.interface import SchedulerInterface
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import create_request_queue
from pagedllm.core.request_update import update_request_with_output
from pagedllm.core.sched_output import GrammarOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedllm.core.scheduler_state import scheduler_snapshot
from pagedllm.protocol import EngineCoreOutput
from pagedllm.spec_decode.drafts import admissible_drafts, num_lookahead_slots
from pagedllm.spec_decode.metrics import SpecDecodingStats


@dataclass(slots=True)
class _StepPlan:
    """What one `schedule()` has handed out so far."""

    budget: int  # tokens left
    encoder_budget: int = 0  # image embeddings the encoder may still make this step
    num_scheduled: dict[str, int] = field(default_factory=dict)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)  # req_id → its images encoded this step
    preempted: set[str] = field(default_factory=set)
    blocked: bool = False  # a request to preempt has a step in flight: wait for it


class Scheduler(SchedulerInterface):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        structured_output_manager=None,
        speculative_config: SpeculativeConfig | None = None,
        max_loras: int | None = None,
        pipeline_depth: int = 1,
    ) -> None:
        self.config = scheduler_config
        # Most distinct LoRA adapters among the running requests (the workers' slots); None: no LoRA.
        self.max_loras = max_loras
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.structured_output_manager = structured_output_manager
        # Outputs produced outside a forward pass (e.g. a grammar that failed to compile).
        self.pending_outputs: list[EngineCoreOutput] = []
        self.speculative_config = speculative_config
        self.num_lookahead_tokens = speculative_config.num_lookahead_tokens if speculative_config else 0
        self.spec_decoding_stats = SpecDecodingStats()
        # req_id → its steps scheduled and not yet updated (several with pipeline parallel's batch
        # queue). Such a request is never preempted: its step's output would be lost, and seeded
        # sampling would have drawn for nothing. The scheduler waits for the step instead.
        self.num_steps_in_flight: dict[str, int] = {}
        # Steps the engine core keeps in flight (pipeline stages): the running requests are split
        # over that many steps, so each stage has a batch to work on while the next one runs.
        self.pipeline_depth = pipeline_depth
        # Requests whose id an ended request's step in flight still carries: added once it is back.
        self.deferred: dict[str, Request] = {}
        # The workers append their own samples, and the next step is scheduled before this one's
        # tokens come back (see `Request.num_output_placeholders`).
        self.async_scheduling = scheduler_config.async_scheduling
        self.encoder_cache_manager = EncoderCacheManager(scheduler_config.encoder_cache_size)

    # ---- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.deferred:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if request.request_id in self.num_steps_in_flight:
            # An earlier request of this id ended while a step of its is in flight (async
            # scheduling, pipeline parallel): that step's row must not reach this one.
            self.deferred[request.request_id] = request
            return
        so_params = request.sampling_params.structured_outputs
        if so_params is not None:
            if self.structured_output_manager is None:
                raise ValueError("structured outputs are not enabled in this engine")
            request.structured_output = self.structured_output_manager.submit(so_params, request.prompt_token_ids)
            request.status = RequestStatus.WAITING_FOR_FSM
        self.requests[request.request_id] = request
        self.kv_cache_manager.add_request(request)
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or otherwise end) requests wherever they are; unknown ids are ignored."""
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None and req_id in self.deferred:
                request = self.deferred.pop(req_id)
                request.status = status
                finished.append(request)
                continue
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def _free_request(self, request: Request) -> None:
        if request.structured_output is not None:
            request.structured_output.cancel()  # a compile still running for a request gone is dropped
        request.structured_output = None
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.deferred)

    # ---- scheduling -------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.prompt_logprobs = None  # the recompute produces them again
        request.spec_token_ids = []
        request.num_output_placeholders = 0  # never preempted with a step in flight: none are pending
        request.num_synced_tokens = request.num_synced_blocks = 0  # the workers drop it
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # FCFS: the newest running request

    def _num_known_and_pending(self, request: Request) -> int:
        """The tokens a running request can compute up to: its known ones and drafts, and with
        async scheduling the ones steps in flight sample, unless those already end it."""
        pending = request.num_output_placeholders
        if pending and (request.num_output_tokens + pending >= request.max_tokens
                        or request.num_tokens + pending >= self.max_model_len):
            return request.num_computed_tokens  # its last token is in flight: nothing to add
        return request.num_tokens_with_spec + pending

    def _chunk(self, num_new: int, budget: int, prefill: bool = True) -> int:
        """Tokens a request computes this step: what it has left, within the step's budget and,
        while its prompt is being computed, `long_prefill_token_threshold` (0: no such cap; a
        decode with draft tokens to verify is never cut short by it)."""
        threshold = self.config.long_prefill_token_threshold
        return min(num_new, budget, threshold) if prefill and threshold > 0 else min(num_new, budget)

    def schedule(self) -> SchedulerOutput:
        """The running requests first (oldest first; preempting the newest when blocks run out),
        then, unless that had to preempt, the waiting ones, within the step's token budget."""
        # A request that waited for an earlier one's step with its id: that step is back (taken
        # or forgotten), so it joins now.
        for req_id in [r for r in self.deferred if r not in self.num_steps_in_flight]:
            self.add_request(self.deferred.pop(req_id))
        step = _StepPlan(self.config.max_num_batched_tokens, self.config.max_num_encoder_input_tokens)
        self._schedule_running(step)
        if not step.preempted and not step.blocked:
            self._schedule_waiting(step)
        return self._build_output(step.num_scheduled, step.preempted, step.encoder_inputs)

    def _schedule_encoder_inputs(self, request: Request, num_computed: int, num_new: int,
                                 step: _StepPlan) -> tuple[list[int], int]:
        """The images whose placeholders these `num_new` tokens reach and the workers do not hold,
        to encode this step; where one does not fit the encoder budget or cache, the step stops
        before its placeholders (possibly at 0 tokens: the request waits)."""
        to_encode: list[int] = []
        idents: set[str] = set()
        pending = 0
        cache = self.encoder_cache_manager
        for i, f in enumerate(request.mm_features):
            if f.offset >= num_computed + num_new:
                break  # this image and the ones after it are for later steps
            if f.offset + f.length <= num_computed:
                continue  # its placeholders are in the KV cache already
            if self.config.disable_chunked_mm_input and num_computed + num_new < f.offset + f.length:
                # The chunk would end inside the image: stop before it, or (starting in it, after a
                # prefix-cache hit) take all of its rest, which may pass long_prefill_token_threshold.
                if f.offset > num_computed:
                    num_new = f.offset - num_computed
                    break
                rest = f.offset + f.length - num_computed
                if rest > step.budget:
                    num_new = 0
                    break
                num_new = rest
            if f.identifier in idents or cache.check_and_update_cache(request, i):
                continue
            if not cache.can_allocate(request, i, step.encoder_budget - pending, pending):
                num_new = f.offset - num_computed  # up to the image; it is encoded in a later step
                break
            to_encode.append(i)
            idents.add(f.identifier)
            pending += f.length
        return to_encode, max(0, num_new)

    def _take_encoder_inputs(self, request: Request, to_encode: list[int], step: _StepPlan) -> None:
        """The request is scheduled: its images to encode take their room and budget."""
        if not to_encode:
            return
        for i in to_encode:
            self.encoder_cache_manager.allocate(request, i)
            step.encoder_budget -= request.mm_features[i].length
        step.encoder_inputs[request.request_id] = to_encode

    def _drop_encoder_inputs(self, request: Request, step: _StepPlan) -> None:
        """A request preempted after it was scheduled this step gives back its encoder budget."""
        for i in step.encoder_inputs.pop(request.request_id, ()):
            step.encoder_budget += request.mm_features[i].length

    def _schedule_running(self, step: _StepPlan) -> None:
        """Each running request's next tokens (a decode, the rest of a chunked prompt, drafts to
        verify), its share of the pipeline's steps at most; preempt from the newest when blocks run
        out, or stop (`blocked`) when the one to preempt has a step in flight."""
        i = 0
        per_step = -(-len(self.running) // self.pipeline_depth)
        while i < len(self.running) and step.budget > 0 and len(step.num_scheduled) < per_step:
            request = self.running[i]
            # Draft tokens are scheduled like any other: verified in this forward pass.
            num_new = self._chunk(self._num_known_and_pending(request) - request.num_computed_tokens, step.budget,
                                  prefill=request.num_computed_tokens < request.num_prompt_tokens)
            to_encode: list[int] = []
            if request.mm_features and num_new > 0:
                to_encode, num_new = self._schedule_encoder_inputs(request, request.num_computed_tokens, num_new, step)
            if num_new <= 0:
                i += 1
                continue
            lookahead = num_lookahead_slots(
                self.num_lookahead_tokens, self.max_model_len, request.num_computed_tokens + num_new
            )
            while True:
                if self.kv_cache_manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead) is not None:
                    break
                victim = self._pick_victim()
                if self.num_steps_in_flight.get(victim.request_id):
                    step.blocked = True  # wait for its step (the batch queue finishes the oldest one)
                    break
                if victim.request_id in step.num_scheduled:
                    step.budget += step.num_scheduled.pop(victim.request_id)
                    self._drop_encoder_inputs(victim, step)
                    i -= 1
                self._preempt(victim)
                step.preempted.add(victim.request_id)
                if victim is request:
                    break
            if step.blocked:
                break
            if request.request_id in step.preempted:
                continue  # `i` already points at the next request
            step.num_scheduled[request.request_id] = num_new
            step.budget -= num_new
            self._take_encoder_inputs(request, to_encode, step)
            i += 1

    def _schedule_waiting(self, step: _StepPlan) -> None:
        """Admit waiting requests in queue order while budget, blocks and max_num_seqs allow. A
        request whose grammar still compiles, whose adapter has no free slot, or whose sibling is
        computing the shared prompt is passed over this step and keeps its place."""
        skipped: list[Request] = []  # grammars still compiling, samples waiting for a sibling's prefill
        active_loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        while len(self.waiting) and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.status == RequestStatus.WAITING_FOR_FSM:
                if not request.structured_output.ready():
                    skipped.append(self.waiting.pop())
                    continue
                if request.structured_output.error is not None:
                    self._fail_grammar(request)
                    continue
                request.status = RequestStatus.WAITING
            lora = request.lora_request
            if lora is not None and self.max_loras is not None and lora.lora_int_id not in active_loras:
                if len(active_loras) >= self.max_loras:
                    skipped.append(self.waiting.pop())  # its adapter waits for a free slot; the queue goes on
                    continue
                active_loras.add(lora.lora_int_id)
            if self.kv_cache_manager.waits_for_sibling(request):
                skipped.append(self.waiting.pop())  # the rest of the queue goes on meanwhile
                continue
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > step.budget:
                break
            num_new = self._chunk(num_new, step.budget)
            to_encode: list[int] = []
            if request.mm_features:
                to_encode, num_new = self._schedule_encoder_inputs(request, num_computed, num_new, step)
                if num_new == 0:
                    # Its next image waits for encoder budget or cache room; the queue keeps its order.
                    # A waiting request pins no cached image (running ones may need the room).
                    self.encoder_cache_manager.free(request)
                    break
            lookahead = num_lookahead_slots(self.num_lookahead_tokens, self.max_model_len, num_computed + num_new)
            if self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks, num_computed, lookahead) is None:
                self.encoder_cache_manager.free(request)
                break
            self.waiting.pop()
            if self.kv_cache_manager.enable_caching:
                self.kv_cache_manager.record_prefix_cache_lookup(request.num_tokens, num_computed)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            self.running.append(request)
            step.num_scheduled[request.request_id] = num_new
            step.budget -= num_new
            self._take_encoder_inputs(request, to_encode, step)

        for request in reversed(skipped):
            self.waiting.prepend(request)

    def get_grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        drafts = scheduler_output.scheduled_spec_decode_tokens
        grammar_reqs = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)  # async scheduling: the step before may have ended it
            # It samples when this step reaches its last known token (schedule() advanced it).
            if (request is not None and request.structured_output is not None
                    and request.num_computed_tokens >= request.num_tokens):
                grammar_reqs.append((req_id, request.structured_output, drafts.get(req_id, [])))
        filled = self.structured_output_manager.grammar_bitmask(grammar_reqs) if grammar_reqs else None
        if filled is None:
            return None
        bitmask, first_rows = filled
        return GrammarOutput(first_rows, bitmask)

    # ---- views ------------------------------------------------------------
    def make_stats(self) -> dict[str, float]:
        """With LoRA, also the running and waiting requests per adapter ("lora_running:NAME",
        "lora_waiting:NAME")."""
        kv = self.kv_cache_manager
        pc = kv.prefix_cache_stats
        stats = {"num_running": len(self.running), "num_waiting": len(self.waiting), "kv_cache_usage": kv.usage,
                 "num_free_blocks": kv.get_num_free_blocks(), "num_total_blocks": kv.num_blocks,
                 "prefix_cache_queries": pc.queries, "prefix_cache_hits": pc.hits,
                 "prefix_cache_hit_rate": pc.hit_rate, "num_preemptions": self.num_preemptions}
        if self.speculative_config is not None:
            stats.update(self.spec_decoding_stats.as_dict())
        for prefix, requests in (("lora_running:", self.running), ("lora_waiting:", self.waiting)):
            if self.max_loras is None:
                break  # no LoRA in this engine
            for r in requests:
                if r.lora_request is not None:
                    key = prefix + r.lora_request.lora_name
                    stats[key] = stats.get(key, 0) + 1
        return stats

    def snapshot(self) -> dict[str, Any]:
        return scheduler_snapshot(self.kv_cache_manager, self.running, self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def _fail_grammar(self, request: Request) -> None:
        error = request.structured_output.error  # read before _free_request drops it
        self.waiting.pop()
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
        self.pending_outputs.append(EngineCoreOutput(request.request_id, [], "abort", f"grammar error: {error}"))

    def _build_output(self, num_scheduled: dict[str, int], preempted: set[str],
                      encoder_inputs: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """The step message: requests the workers do not hold go whole, the others as diffs
        (tokens sampled since, blocks allocated since, num_computed_tokens)."""
        out = SchedulerOutput(preempted_req_ids=preempted, finished_req_ids=self.finished_req_ids)
        if not num_scheduled:
            return out  # not sent to the workers: the next step that runs tells them
        self.finished_req_ids = set()
        out.scheduled_encoder_inputs = encoder_inputs or {}
        out.free_encoder_mm_hashes = self.encoder_cache_manager.take_freed()
        out.block_copies = self.kv_cache_manager.take_block_copies()
        cached = out.scheduled_cached_reqs
        now = time.time()
        for request in self.running:
            n = num_scheduled.get(request.request_id)
            if n is None:
                continue
            req_id = request.request_id
            start = request.num_computed_tokens
            spec = request.spec_token_ids[: start + n - request.num_tokens]
            if spec:
                out.scheduled_spec_decode_tokens[req_id] = spec
            request.spec_token_ids = []  # verified this step; the drafter proposes anew after it
            block_ids = self.kv_cache_manager.get_block_ids(req_id)
            if request.first_scheduled_time is None:  # for the front's queue and prefill times
                request.first_scheduled_time = now
            if request.num_synced_tokens == 0:
                out.scheduled_new_reqs.append(NewRequestData(
                    req_id, request.prompt_token_ids, request.sampling_params, block_ids, start,
                    request.output_token_ids[:], request.pooling_params, request.token_type_ids,
                    request.lora_request, request.mm_features))
            else:
                cached.req_ids.append(req_id)
                cached.new_token_ids.append(request.all_token_ids[request.num_synced_tokens :])
                cached.new_block_ids.append(block_ids[request.num_synced_blocks :])
                cached.num_computed_tokens.append(start)
            request.num_synced_tokens = request.num_tokens
            request.num_synced_blocks = len(block_ids)
            out.num_scheduled_tokens[req_id] = n
            self.num_steps_in_flight[req_id] = self.num_steps_in_flight.get(req_id, 0) + 1
            # Advance now, so the next schedule() sees these tokens as in flight.
            request.num_computed_tokens = start + n
            if self.async_scheduling and request.pooling_params is None and start + n >= (
                    request.num_tokens + request.num_output_placeholders):
                request.num_output_placeholders += 1  # it samples this step
            out.total_num_scheduled_tokens += n
        return out

    # ---- after the forward pass ------------------------------------------
    def _free_encoder_inputs(self, request: Request) -> None:
        """Images whose placeholders are all computed: this request needs their embeddings no more."""
        for i, f in enumerate(request.mm_features):
            if f.offset + f.length <= request.num_computed_tokens:
                self.encoder_cache_manager.free_encoder_input(request, i)

    def forget_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step is back (or its output lost): its requests no longer have it in flight."""
        for req_id in scheduler_output.num_scheduled_tokens:
            left = self.num_steps_in_flight.pop(req_id, 0) - 1
            if left > 0:
                self.num_steps_in_flight[req_id] = left

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Take back rejected drafts, append new tokens, apply stop conditions, cache full blocks."""
        outputs: list[EngineCoreOutput] = []
        self.forget_step(scheduler_output)
        logprobs = runner_output.logprobs
        proposals = runner_output.spec_token_ids
        # The runner's rows are the scheduled requests, in order.
        for row, (req_id, tokens) in enumerate(zip(runner_output.req_ids, runner_output.sampled_token_ids)):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # aborted while its step ran
            pooled = runner_output.pooler_output[row] if runner_output.pooler_output else None
            if pooled is not None:  # a pooling request is done once its prompt is computed
                request.status = RequestStatus.FINISHED_STOPPED
                outputs.append(EngineCoreOutput(req_id, [], "stop", num_cached_tokens=max(0, request.num_cached_tokens),
                                                pooling_output=pooled))
                self.running.remove(request)
                self._free_request(request)
                continue
            if request.mm_features:
                self._free_encoder_inputs(request)
            chunk_prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if chunk_prompt_logprobs is not None:
                request.prompt_logprobs = (request.prompt_logprobs or []) + chunk_prompt_logprobs
            if tokens is None:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
                continue  # a prefill chunk that did not reach the end of the prompt
            if self.async_scheduling:
                request.num_output_placeholders -= 1
                request.num_synced_tokens += len(tokens)  # the workers appended their sample already
            entries = logprobs[row] if logprobs is not None else None
            output, stopped = update_request_with_output(
                request, tokens, len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ())), entries,
                self.max_model_len, self.spec_decoding_stats,
            )
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            outputs.append(output)
            if stopped:
                self.running.remove(request)
                self._free_request(request)
            elif proposals is not None and proposals[row]:
                request.spec_token_ids = admissible_drafts(
                    request, proposals[row], self.max_model_len, self.speculative_config,
                    self.structured_output_manager,
                )
        return outputs
