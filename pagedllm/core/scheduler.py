"""V1-style scheduler: every request's num_computed_tokens catches up to its num_tokens.

There is no prefill or decode phase. Each step hands out a token budget, running
requests first (so decodes never starve), then waiting ones; a prompt that does
not fit the budget is chunked. When blocks run out, a running request is
preempted (its blocks freed, to be recomputed later).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import create_request_queue
from pagedllm.core.request_update import admissible_drafts, num_lookahead_slots, update_request_with_output
from pagedllm.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.engine import EngineCoreOutput
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.metrics import SpecDecodingStats


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        structured_output_manager=None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.group_leaders: dict[str, Request] = {}  # n > 1: the sibling that prefills first
        self.structured_output_manager = structured_output_manager
        # Outputs produced outside a forward pass (e.g. a grammar that failed to compile).
        self.pending_outputs: list[EngineCoreOutput] = []
        self.speculative_config = speculative_config
        self.num_lookahead_tokens = speculative_config.num_lookahead_tokens if speculative_config else 0
        self.spec_decoding_stats = SpecDecodingStats()

    # ---- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        so_params = request.sampling_params.structured_outputs
        if so_params is not None:
            if self.structured_output_manager is None:
                raise ValueError("structured outputs are not enabled in this engine")
            request.structured_output = self.structured_output_manager.submit(so_params)
            request.status = RequestStatus.WAITING_FOR_FSM
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or otherwise end) requests wherever they are; unknown ids are ignored."""
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
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
        request.structured_output = None
        if request.group_id is not None and self.group_leaders.get(request.group_id) is request:
            del self.group_leaders[request.group_id]
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    # ---- scheduling -------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.prompt_logprobs = None  # the recompute produces them again
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # FCFS: the newest running request

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        preempted: set[str] = set()

        # 1. Running requests, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            # Draft tokens are scheduled like any other: verified in this forward pass.
            num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, budget)
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
                if victim.request_id in num_scheduled:
                    budget += num_scheduled.pop(victim.request_id)
                    i -= 1
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if request.request_id in preempted:
                continue  # `i` already points at the next request
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            i += 1

        # 2. Waiting requests, unless this step already had to preempt.
        skipped: list[Request] = []  # grammars still compiling: they wait, the others go on
        while (
            not preempted
            and len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if request.status == RequestStatus.WAITING_FOR_FSM:
                if not request.structured_output.ready():
                    skipped.append(self.waiting.pop())
                    continue
                if request.structured_output.error is not None:
                    self._fail_grammar(request)
                    continue
                request.status = RequestStatus.WAITING
            if self._wait_for_sibling(request):
                break
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            lookahead = num_lookahead_slots(self.num_lookahead_tokens, self.max_model_len, num_computed + num_new)
            if self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks, num_computed, lookahead) is None:
                break
            self.waiting.pop()
            if self.kv_cache_manager.enable_caching:
                self.kv_cache_manager.record_prefix_cache_lookup(request.num_tokens, num_computed)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            self.running.append(request)
            if request.group_id is not None:
                self.group_leaders.setdefault(request.group_id, request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        for request in reversed(skipped):
            self.waiting.prepend(request)
        return self._build_output(num_scheduled, preempted)

    def _fail_grammar(self, request: Request) -> None:
        error = request.structured_output.error  # read before _free_request drops it
        self.waiting.pop()
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
        self.pending_outputs.append(EngineCoreOutput(request.request_id, [], "abort", f"grammar error: {error}"))

    def _wait_for_sibling(self, request: Request) -> bool:
        """Samples of one prompt (n > 1) start after the first has its prompt in the cache,
        so they share its blocks (ref counts) instead of computing copies."""
        if request.group_id is None or not self.kv_cache_manager.enable_caching:
            return False
        leader = self.group_leaders.get(request.group_id)
        return (
            leader is not None
            and leader.status == RequestStatus.RUNNING
            and leader.num_computed_tokens < leader.num_prompt_tokens
        )

    def _build_output(self, num_scheduled: dict[str, int], preempted: set[str]) -> SchedulerOutput:
        out = SchedulerOutput(preempted_req_ids=preempted, finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        for request in self.running:
            n = num_scheduled.get(request.request_id)
            if n is None:
                continue
            start = request.num_computed_tokens
            token_ids = request.all_token_ids[start : start + n]
            spec = request.spec_token_ids[: start + n - request.num_tokens]
            if spec:
                token_ids += spec
            request.spec_token_ids = []  # verified this step; the drafter proposes anew after it
            out.scheduled.append(
                ScheduledRequest(
                    req_id=request.request_id,
                    token_ids=token_ids,
                    start_pos=start,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    sample=start + n >= request.num_tokens,
                    sampling_params=request.sampling_params,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    spec_token_ids=spec,
                )
            )
            # Advance now, so the next schedule() sees these tokens as in flight.
            request.num_computed_tokens = start + n
            out.total_num_scheduled_tokens += n
        grammar_reqs = [
            (s.req_id, self.requests[s.req_id].structured_output, s.spec_token_ids)
            for s in out.scheduled
            if s.sample and self.requests[s.req_id].structured_output is not None
        ]
        if grammar_reqs:
            out.grammar_bitmask, out.grammar_rows = self.structured_output_manager.grammar_bitmask(grammar_reqs)
        return out

    # ---- after the forward pass ------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Take back rejected drafts, append new tokens, apply stop conditions, cache full blocks."""
        outputs: list[EngineCoreOutput] = []
        logprobs = runner_output.logprobs
        proposals = runner_output.spec_token_ids
        # The runner's rows are the scheduled requests, in order.
        for row, (req_id, tokens) in enumerate(zip(runner_output.req_ids, runner_output.sampled_token_ids)):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # aborted while its step ran
            chunk_prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if chunk_prompt_logprobs is not None:
                request.prompt_logprobs = (request.prompt_logprobs or []) + chunk_prompt_logprobs
            if tokens is None:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
                continue  # a prefill chunk that did not reach the end of the prompt
            entries = logprobs[row] if logprobs is not None else None
            output, stopped = update_request_with_output(
                request, tokens, len(scheduler_output.scheduled[row].spec_token_ids), entries, self.max_model_len,
                self.spec_decoding_stats,
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
