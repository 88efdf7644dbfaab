"""Engine-core side of structured outputs: compile grammars off the busy loop, keep one
matcher per request, build the step's token bitmask, advance matchers on accepted tokens."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import ModelConfig
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.grammar import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StructuredOutputRequest:
    params: StructuredOutputsParams
    future: Future
    matcher: Any = None
    error: str | None = None

    def ready(self) -> bool:
        """True once compiled (matcher built) or failed (error set)."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.future.result())
        except Exception as e:
            self.error = str(e)
        return True


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self.vocab_size = model_config.text_config.vocab_size
        # One worker: compilations are short, and they must not take the cores from the forward pass.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler: GrammarCompiler | None = None

    def _compile(self, params: StructuredOutputsParams) -> Any:
        if self._compiler is None:  # the tokenizer is needed only once a grammar request arrives
            from pagedllm.model_executor.loader.tokenizer import get_eos_token_ids, get_tokenizer

            mc = self.model_config
            tokenizer = get_tokenizer(mc.tokenizer, mc.trust_remote_code)
            stop_ids = get_eos_token_ids(mc.model_path, tokenizer)
            self._compiler = GrammarCompiler(tokenizer, self.vocab_size, stop_ids)
        return self._compiler.compile(params)

    def submit(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        return StructuredOutputRequest(params, self.executor.submit(self._compile, params))

    def grammar_bitmask(self, requests: list[tuple[str, StructuredOutputRequest]]) -> tuple[torch.Tensor, dict]:
        """Bitmask rows for the requests about to sample: row i allows the tokens its
        matcher accepts next. Returns (bitmask, req_id → row)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        rows = {}
        for i, (req_id, so) in enumerate(requests):
            so.matcher.fill_next_token_bitmask(bitmask, i)
            rows[req_id] = i
        return bitmask, rows

    @staticmethod
    def accept_token(so: StructuredOutputRequest, token: int) -> bool:
        """Advance the matcher; False if the grammar rejects the token."""
        return so.matcher.accept_token(token)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
