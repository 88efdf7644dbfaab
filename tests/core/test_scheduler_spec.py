"""The scheduler with speculative decoding: drafts are scheduled as tokens, rejected ones are
rolled back, and prefix-cache hashes only ever cover verified tokens."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from tests.core.conftest import BS, WorkerView, make_req


def _scheduler(method: str = "ngram", k: int = 3, **kw) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=kw.get("budget", 64), max_model_len=64,
                        long_prefill_token_threshold=kw.get("threshold", 0)),
        CacheConfig(block_size=BS, num_blocks=kw.get("num_blocks", 32)),
        speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=k),
    )


def _step(sched: Scheduler, tokens: dict[str, list[int]], drafts: dict[str, list[int]] | None = None):
    if not hasattr(sched, "worker_view"):
        sched.worker_view = WorkerView()
    message = sched.schedule()
    out = sched.worker_view.apply(message)
    ids = [s.req_id for s in out.scheduled]
    runner = ModelRunnerOutput(ids, [tokens.get(i) for i in ids],
                               spec_token_ids=[(drafts or {}).get(i) for i in ids])
    return out, sched.update_from_output(message, runner)


def test_drafts_are_scheduled_then_rejected_ones_rolled_back():
    sched = _scheduler()
    req = make_req("a", [10, 11, 12, 13, 14], max_tokens=20)
    sched.add_request(req)
    out, _ = _step(sched, {"a": [20]}, {"a": [21, 22, 23]})
    assert req.spec_token_ids == [21, 22, 23] and req.num_computed_tokens == 5
    out, outputs = _step(sched, {"a": [21, 30]}, {"a": [31]})  # first draft accepted, then 30
    (s,) = out.scheduled
    assert s.token_ids == [20, 21, 22, 23] and s.spec_token_ids == [21, 22, 23] and s.start_pos == 5
    assert outputs[0].new_token_ids == [21, 30]
    assert req.output_token_ids == [20, 21, 30]
    # 5 prompt + 20 + 21 verified; 30 is known but not computed yet; 22 and 23 were rolled back.
    assert req.num_computed_tokens == 7 and req.num_tokens == 8
    assert sched.spec_decoding_stats.num_draft_tokens == 3
    assert sched.spec_decoding_stats.num_accepted_tokens == 1


def test_block_hashes_never_cover_unverified_tokens():
    sched = _scheduler(k=4)
    req = make_req("a", [10, 11, 12], max_tokens=20)  # BS = 4
    sched.add_request(req)
    _step(sched, {"a": [20]}, {"a": [21, 22, 23, 24]})
    # The step computes positions 3..7 (20, 21, 22, 23, 24): all drafts rejected.
    _step(sched, {"a": [40]})
    kv = sched.kv_cache_manager
    # Only block 0 (10 11 12 20) holds verified tokens; block 1 held drafts and must not be cached.
    assert kv.num_cached_blocks["a"] == 1
    assert len(req.block_hashes) == 1  # 10 11 12 20 | 40 (partial)
    assert req.all_token_ids == [10, 11, 12, 20, 40] and req.num_computed_tokens == 4


def test_drafts_limited_by_max_tokens_and_token_budget():
    sched = _scheduler(k=5, budget=3)
    req = make_req("a", [10, 11], max_tokens=4)
    sched.add_request(req)
    _step(sched, {"a": [20]}, {"a": [1, 2, 3, 4, 5]})
    assert req.spec_token_ids == [1, 2]  # 3 more tokens allowed: 2 drafts + 1 sampled
    out, _ = _step(sched, {"a": [1, 7]})
    (s,) = out.scheduled
    assert s.token_ids == [20, 1, 2] and s.spec_token_ids == [1, 2]


def test_budget_cuts_the_drafts():
    sched = _scheduler(k=5, budget=2)
    req = make_req("a", [10], max_tokens=20)
    sched.add_request(req)
    _step(sched, {"a": [20]}, {"a": [1, 2, 3, 4, 5]})
    out, _ = _step(sched, {"a": [1, 9]})
    (s,) = out.scheduled
    assert s.token_ids == [20, 1] and s.spec_token_ids == [1]
    assert req.output_token_ids == [20, 1, 9] and req.num_computed_tokens == 3


def test_long_prefill_threshold_chunks_the_prompt_not_the_drafts():
    """A threshold of 2 splits the 5-token prompt into 2 + 2 + 1, then the decode verifies all
    of its 3 drafts in one step: the cap is for prompts only."""
    sched = _scheduler(k=3, threshold=2)
    req = make_req("a", [10, 11, 12, 13, 14], max_tokens=20)
    sched.add_request(req)
    sizes = [len(_step(sched, {})[0].scheduled[0].token_ids) for _ in range(2)]
    out, _ = _step(sched, {"a": [20]}, {"a": [21, 22, 23]})
    assert sizes + [len(out.scheduled[0].token_ids)] == [2, 2, 1]
    out, _ = _step(sched, {"a": [21, 22, 23, 24]})
    (s,) = out.scheduled
    assert s.token_ids == [20, 21, 22, 23] and req.output_token_ids == [20, 21, 22, 23, 24]


def test_draft_model_allocates_lookahead_slots_and_frees_everything():
    sched = _scheduler(method="draft_model", k=3)
    req = make_req("a", [10, 11, 12, 13], max_tokens=3)  # one block of prompt
    sched.add_request(req)
    sched.schedule()
    # 4 prompt tokens + 3 lookahead slots for the draft model's proposals: two blocks.
    assert len(sched.kv_cache_manager.get_block_ids("a")) == 2
    sched.finish_requests(["a"], req.status.FINISHED_ABORTED)
    assert sched.kv_cache_manager.get_num_free_blocks() == 32


def test_preemption_drops_the_drafts():
    sched = _scheduler()
    req = make_req("a", [10, 11], max_tokens=20)
    sched.add_request(req)
    _step(sched, {"a": [20]}, {"a": [1, 2]})
    sched._preempt(req)
    assert req.spec_token_ids == [] and req.num_computed_tokens == 0
