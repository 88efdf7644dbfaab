"""A scripted stand-in for AsyncLLM (an EngineClient), so the HTTP layer is tested without an
engine process: each choice of a request emits the words " w0", " w1", ... one per step."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.logprobs import Logprob
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

MAX_MODEL_LEN = 64
VOCAB = 384


class FakeEngine:
    def __init__(self, tokenizer, model_path: str, step_delay: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=MAX_MODEL_LEN, model="fake-model", model_path=model_path)
        self.step_delay = step_delay
        self.errored = False
        self.live: set[str] = set()
        self.aborted: list[str] = []
        self.calls: list[tuple] = []

    @property
    def is_running(self) -> bool:
        return not self.errored

    def get_tokenizer(self):
        return self.tokenizer

    async def encode(self, prompt, pooling_params, request_id, priority=0):
        raise ValueError("this model runs --runner generate")
        yield  # an async generator, as AsyncLLM.encode

    async def generate(self, prompt, sampling_params, request_id, priority=0, cache_salt=None):
        if self.errored:
            raise EngineDeadError()
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        if any(t >= VOCAB for t in ids):
            raise ValueError(f"prompt token ids out of vocabulary (size {VOCAB})")
        self.calls.append((prompt, sampling_params, request_id, priority, cache_salt))
        self.live.add(request_id)
        metrics = RequestMetrics(arrival_time=time.time())
        finished = False
        try:
            for step in range(sampling_params.max_tokens):
                await asyncio.sleep(self.step_delay)
                if self.errored:
                    raise EngineDeadError()
                now = time.time()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                last = step == sampling_params.max_tokens - 1
                outs = []
                for i in range(sampling_params.n):
                    tokens = [10 + i + s for s in range(step + 1)]
                    logprobs = None
                    if sampling_params.logprobs is not None:
                        logprobs = [{t: Logprob(-0.5, 1, f" w{s}"), 99: Logprob(-1.5, 2, "x")}
                                    for s, t in enumerate(tokens)]
                    outs.append(CompletionOutput(
                        index=i, text="".join(f" w{s}" for s in range(step + 1)), token_ids=tokens,
                        cumulative_logprob=None, logprobs=logprobs, finish_reason="length" if last else None,
                    ))
                finished = last
                if last:
                    metrics.finished_time = now
                yield RequestOutput(request_id, prompt.get("prompt") if isinstance(prompt, dict) else None,
                                    list(ids), outs, finished, metrics)
        finally:
            self.live.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self.live:
            self.aborted.append(request_id)

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError()

    async def reset_prefix_cache(self) -> bool:
        return True

    async def get_stats(self) -> dict:
        if self.errored:
            raise EngineDeadError()
        return {"num_running": len(self.live), "num_waiting": 0, "kv_cache_usage": 0.25 * bool(self.live),
                "prefix_cache_queries": 10, "prefix_cache_hits": 4, "prefix_cache_hit_rate": 0.4,
                "num_preemptions": 1}

    async def get_engine_stats(self) -> list[dict]:
        return [await self.get_stats()]

    def shutdown(self) -> None:
        pass
