"""A scripted stand-in for AsyncLLM (an EngineClient), so the HTTP layer is tested without an
engine process: each choice of a request emits the words " w0", " w1", ... one per step, in outputs of the
request's `output_kind` (everything so far, what is new, or the end only).
With `lora_config` set, adapters are checked as the engine would: a path holding no
adapter_config.json is a ValueError."""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

from pagedllm.config import CacheConfig, LoRAConfig
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.logprobs import Logprob
from pagedllm.engine.step_stats import IterationTokens
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind

MAX_MODEL_LEN = 64
VOCAB = 384
FAKE_NUM_BLOCKS = 16


class FakeEngine:
    def __init__(self, tokenizer, model_path: str, step_delay: float = 0.0,
                 lora_config: LoRAConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=MAX_MODEL_LEN, model="fake-model", model_path=model_path)
        self.config = SimpleNamespace(cache_config=CacheConfig(block_size=16))
        self.iteration_tokens = IterationTokens()  # per step: the prompt, then one token per sample
        self.step_delay = step_delay
        self.errored = False
        self.live: set[str] = set()
        self.aborted: list[str] = []
        self.calls: list[tuple] = []
        self.lora_config = lora_config
        self.loras: dict[int, object] = {}  # added adapters by lora_int_id
        self.removed_loras: list[int] = []

    @property
    def is_running(self) -> bool:
        return not self.errored

    def get_tokenizer(self):
        return self.tokenizer

    def expand_image_placeholders(self, token_ids, images):
        raise ValueError("the fake engine's model is text-only")

    async def encode(self, prompt, pooling_params, request_id, priority=0):
        raise ValueError("this model runs --runner generate")
        yield  # an async generator, as AsyncLLM.encode

    async def generate(self, prompt, sampling_params, request_id, priority=0, cache_salt=None, lora_request=None):
        if self.errored:
            raise EngineDeadError()
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        if any(t >= VOCAB for t in ids):
            raise ValueError(f"prompt token ids out of vocabulary (size {VOCAB})")
        if lora_request is not None:
            await self.add_lora(lora_request)
        self.calls.append((prompt, sampling_params, request_id, priority, cache_salt, lora_request))
        self.live.add(request_id)
        metrics = RequestMetrics(arrival_time=time.time())
        metrics.first_scheduled_time = time.time()
        finished = False
        try:
            for step in range(sampling_params.max_tokens):
                self.iteration_tokens.observe(len(ids) if step == 0 else sampling_params.n)
                await asyncio.sleep(self.step_delay)
                if self.errored:
                    raise EngineDeadError()
                now = time.time()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                last = step == sampling_params.max_tokens - 1
                kind = sampling_params.output_kind
                if kind == RequestOutputKind.FINAL_ONLY and not last:
                    continue
                steps = range(step, step + 1) if kind == RequestOutputKind.DELTA else range(step + 1)
                outs = []
                for i in range(sampling_params.n):
                    tokens = [10 + i + s for s in steps]
                    logprobs = None
                    if sampling_params.logprobs is not None:
                        logprobs = [{t: Logprob(-0.5, 1, f" w{s}"), 99: Logprob(-1.5, 2, "x")}
                                    for s, t in zip(steps, tokens)]
                    outs.append(CompletionOutput(
                        index=i, text="".join(f" w{s}" for s in steps), token_ids=tokens,
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

    async def add_lora(self, lora_request) -> bool:
        if self.lora_config is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True (--enable-lora)")
        if lora_request.lora_int_id in self.loras:
            return False
        if not os.path.isfile(os.path.join(lora_request.lora_path, "adapter_config.json")):
            raise ValueError(f"LoRA adapter {lora_request.lora_path!r}: no adapter_config.json in it")
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        self.removed_loras.append(lora_int_id)
        return self.loras.pop(lora_int_id, None) is not None

    async def get_stats(self) -> dict:
        if self.errored:
            raise EngineDeadError()
        stats = {"num_running": len(self.live), "num_waiting": 0, "kv_cache_usage": 0.25 * bool(self.live),
                 "prefix_cache_queries": 10, "prefix_cache_hits": 4, "prefix_cache_hit_rate": 0.4,
                 "num_preemptions": 1, "num_total_blocks": 64, **self.iteration_tokens.as_dict()}
        if self.lora_config is not None:
            for call in self.calls:
                request_id, lora = call[2], call[5]
                if lora is not None and request_id in self.live:
                    key = f"lora_running:{lora.lora_name}"
                    stats[key] = stats.get(key, 0) + 1
        return stats

    async def get_engine_stats(self) -> list[dict]:
        return [await self.get_stats()]

    async def get_scheduler_state(self) -> list[dict]:
        """FAKE_NUM_BLOCKS blocks: two in use per live request, in order; one cached, the rest free."""
        stats = await self.get_stats()
        live = sorted(self.live)
        states = ["u"] * (2 * len(live)) + ["c"]
        states += ["f"] * (FAKE_NUM_BLOCKS - len(states))
        requests = [{"id": req_id, "queue": "running", "status": "running", "prompt_tokens": 3, "computed_tokens": 4,
                     "prompt_computed": 3, "output_tokens": 1, "max_tokens": None, "cached_tokens": 0,
                     "num_preemptions": 0, "priority": 0, "arrival_time": time.time(), "first_token_time": None,
                     "lora": None, "num_blocks": 2, "block_ids": [2 * i, 2 * i + 1]} for i, req_id in enumerate(live)]
        return [{"timestamp": time.time(), "block_size": 16, "num_blocks": FAKE_NUM_BLOCKS,
                 "num_free_blocks": FAKE_NUM_BLOCKS - 2 * len(live), "num_cached_blocks": 1,
                 "block_states": "".join(states[:FAKE_NUM_BLOCKS]), "blocks_truncated": False,
                 "requests": requests, "stats": stats}]

    def shutdown(self) -> None:
        pass
