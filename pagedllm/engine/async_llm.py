"""AsyncLLM: the serving engine. Tokenizing, detokenizing and streaming happen here, in
the server's process; scheduling and the forward pass run in the engine-core process (one per
data-parallel rank, each with its own executor and KV cache, requests spread by load)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, TypeVar

from pagedllm.config import LoRAConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import MPClient
from pagedllm.engine.core_launch import discard_prestarted_core, take_prestarted_core
from pagedllm.engine.dp_balancer import DPLoadBalancer, merge_stats
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.frontend import Frontend
from pagedllm.engine.processor import PromptType
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.protocol import EngineCoreOutputs
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncLLM:
    """Implements EngineClient (engine/protocol.py), what the OpenAI server is written against."""

    def __init__(self, engine_args: EngineArgs) -> None:
        self._queues: dict[str, asyncio.Queue] = {}
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Request processing (tokenizing, schema and bad-words checks) runs in this one thread,
        # off the event loop; one thread keeps requests in their arrival order.
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-processor")
        self._preparing: dict[str, int] = {}  # request id -> generate calls preparing it
        self._aborted_early: set[str] = set()  # aborted while preparing: never submitted
        self.errored = False
        num_engines = engine_args.data_parallel_size
        if num_engines != 1:
            discard_prestarted_core()  # data parallel starts one core per rank
        core = take_prestarted_core()  # `pagedllm serve` starts it before its own imports
        # A model already on disk: the core process builds its own config from the same arguments,
        # and this one is built while it starts (a bad argument stops the core unfinished).
        # Otherwise the config is checked here first, before the core is told, converting a GGUF once.
        early = num_engines == 1 and engine_args.resolves_on_disk()
        if not early:
            try:
                self._configure(engine_args)
            except BaseException:
                if core is not None:
                    core.close()
                raise
        self.balancer = DPLoadBalancer(num_engines)
        if num_engines == 1:  # the client owns `core` from here, and closes it if the start fails
            load = (lambda: self._configure_and_load_frontend(engine_args)) if early else self._load_frontend
            self.clients = [MPClient(engine_args, self._on_outputs, self._on_utility, self._on_dead, core=core,
                                     while_starting=load)]
        else:
            self.clients = self._start_engines(engine_args, num_engines)
        self.client = self.clients[0]

    def _configure(self, engine_args: EngineArgs) -> None:
        self.config = engine_args.create_engine_config()
        self.model_config = self.config.model_config

    def _configure_and_load_frontend(self, engine_args: EngineArgs) -> None:
        self._configure(engine_args)
        self._load_frontend()

    def _start_engines(self, core_args: EngineArgs, num_engines: int) -> list[MPClient]:
        """The data-parallel engine cores, started side by side while the tokenizer loads here
        (each core process builds one EngineCore from the same arguments)."""
        call_ids = itertools.count()
        with ThreadPoolExecutor(num_engines, thread_name_prefix="EngineCoreStart") as pool:
            futures = [pool.submit(MPClient, core_args, self._on_outputs, self._on_utility, self._on_dead,
                                   call_ids=call_ids) for _ in range(num_engines)]
            try:
                self._load_frontend()
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    if f.exception() is None:
                        f.result().close()
                raise

    def _load_frontend(self) -> None:
        """The tokenizer loads here while the engine-core process loads the model."""
        self.frontend = Frontend(self.config.model_config, self.config.scheduler_config,
                                 self.config.structured_outputs_config.reasoning_parser, self.config.lora_config)
        self.tokenizer = self.frontend.tokenizer
        self.processor = self.frontend.processor

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def expand_image_placeholders(self, token_ids: list[int], images: list[Any]) -> list[int]:
        _, expanded, _ = self.processor._multimodal({"prompt_token_ids": token_ids, "multi_modal_data": {
            "image": images}})
        return expanded

    @property
    def is_running(self) -> bool:
        return not self.errored and not any(c.dead for c in self.clients)

    # ---- callbacks from the reader thread: hop onto the event loop --------
    def _call_in_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        self._call_in_loop(self._process_outputs, outputs)

    def _on_utility(self, call_id: int, ok: bool, result: Any) -> None:
        self._call_in_loop(self._resolve_utility, call_id, ok, result)

    def _on_dead(self) -> None:
        self.errored = True
        self._call_in_loop(self._fail_all)

    # ---- on the event loop ------------------------------------------------
    def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        result = self.frontend.process_outputs(outputs.outputs, outputs.timestamp)
        for core_out in outputs.outputs:
            if core_out.finish_reason is not None:
                self.balancer.finished(core_out.request_id)
        for out in result.request_outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
                if out.finished:
                    del self._queues[out.request_id]
        if result.reqs_to_abort:
            self._abort_in_cores(result.reqs_to_abort)

    def _resolve_utility(self, call_id: int, ok: bool, result: Any) -> None:
        fut = self._utility_futures.pop(call_id, None)
        if fut is not None and not fut.done():
            fut.set_result(result) if ok else fut.set_exception(RuntimeError(result))

    def _fail_all(self) -> None:
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError())
        self._queues.clear()
        for fut in self._utility_futures.values():
            if not fut.done():
                fut.set_exception(EngineDeadError())
        self._utility_futures.clear()

    def _bind_loop(self) -> None:
        """Outputs are delivered on the loop of the latest caller (a server has one loop;
        a script calling asyncio.run() twice gets a new one each time)."""
        self._loop = asyncio.get_running_loop()

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Cumulative RequestOutputs as the request progresses; the last has finished=True.
        Closing the generator early aborts the request and frees its KV blocks."""
        self._bind_loop()
        if self.errored:
            raise EngineDeadError()
        if sampling_params.logits_processors:
            raise ValueError("logits_processors cannot cross to the engine-core process; use LLM offline")
        prepared = await self._prepare(request_id, self.frontend.prepare_request, request_id, prompt,
                                       sampling_params, time.time(), priority, cache_salt, lora_request)
        if prepared is None:
            return
        requests = self.frontend.register(*prepared)
        async with aclosing(self._stream(request_id, requests)) as stream:  # closed with the caller's generator
            async for out in stream:
                yield out

    async def encode(
        self, prompt: PromptType, pooling_params: PoolingParams, request_id: str, priority: int = 0,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """The pooled vector of one prompt: one PoolingRequestOutput, finished. Closing the
        generator early aborts the request."""
        self._bind_loop()
        if self.errored:
            raise EngineDeadError()
        prepared = await self._prepare(request_id, self.frontend.prepare_pooling_request, request_id, prompt,
                                       pooling_params, time.time(), priority)
        if prepared is None:
            return
        requests = self.frontend.register(*prepared)
        async with aclosing(self._stream(request_id, requests)) as stream:  # closed with the caller's generator
            async for out in stream:
                yield out

    async def _prepare(self, request_id: str, fn: Callable[..., T], *args: Any) -> T | None:
        """`fn(*args)` in the processing thread, so that a costly request never stalls the loop
        (/health, other streams). None if the request was aborted meanwhile (nothing to submit)."""
        self._preparing[request_id] = self._preparing.get(request_id, 0) + 1
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._prep, functools.partial(fn, *args))
        finally:
            left = self._preparing.pop(request_id) - 1
            aborted = request_id in self._aborted_early
            if left:
                self._preparing[request_id] = left
            else:
                self._aborted_early.discard(request_id)
        if aborted:
            return None
        if self.errored:
            raise EngineDeadError()
        return result

    async def _stream(self, request_id: str, requests: list) -> AsyncGenerator[Any, None]:
        """Send a registered request's engine-core requests to the least loaded core, then yield
        its outputs until the finished one; however it ends early, the request is aborted."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            client = self.clients[self.balancer.assign([r.request_id for r in requests])]
            for request in requests:
                client.add_request(request)
            while not finished:
                out = queue.get_nowait() if not queue.empty() else await queue.get()
                if isinstance(out, Exception):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        if request_id in self._preparing:
            self._aborted_early.add(request_id)
        self._queues.pop(request_id, None)
        core_ids = self.frontend.abort([request_id])
        if core_ids and not self.errored:
            self._abort_in_cores(core_ids)

    def _abort_in_cores(self, core_ids: list[str]) -> None:
        for engine, ids in self.balancer.by_engine(core_ids).items():
            self.clients[engine].abort_requests(ids)
            for req_id in ids:
                self.balancer.finished(req_id)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    async def _call(self, method: str, *args: Any) -> list[Any]:
        """The utility call on every engine core; their results in core order."""
        self._bind_loop()
        if self.errored:
            raise EngineDeadError()
        futures = []
        for client in self.clients:
            fut = asyncio.get_running_loop().create_future()
            self._utility_futures[client.call_utility(method, *args)] = fut
            futures.append(fut)
        return list(await asyncio.gather(*futures))

    async def get_stats(self) -> dict[str, float]:
        """All engine cores together."""
        return merge_stats(await self._call("get_stats"))

    async def get_engine_stats(self) -> list[dict[str, float]]:
        """One entry per data-parallel engine core."""
        return await self._call("get_stats")

    async def get_scheduler_state(self) -> list[dict[str, Any]]:
        """Each engine core's KV block map, queues and stats, for the dashboard; in core order."""
        return await self._call("get_scheduler_state")

    async def reset_prefix_cache(self) -> bool:
        return all(await self._call("reset_prefix_cache"))

    @property
    def lora_config(self) -> LoRAConfig | None:
        return self.config.lora_config

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter against the model (a ValueError says what is wrong; the engine is
        untouched); requests may then name it. Returns whether it is new."""
        return await asyncio.get_running_loop().run_in_executor(None, self.frontend.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        removed = self.frontend.remove_lora(lora_int_id)
        return any(await self._call("remove_lora", lora_int_id)) or removed

    async def check_health(self) -> None:
        if self.errored or not all(c.is_alive() for c in self.clients):
            raise EngineDeadError()

    def shutdown(self) -> None:
        for client in self.clients:
            client.close()
        self._prep.shutdown(wait=False, cancel_futures=True)
