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
            from pagedllm.transformers_utils.tokenizer import get_eos_token_ids, get_tokenizer

            mc = self.model_config
            tokenizer = get_tokenizer(mc.tokenizer, mc.trust_remote_code)
            stop_ids = get_eos_token_ids(mc.model_path, tokenizer)
            self._compiler = GrammarCompiler(tokenizer, self.vocab_size, stop_ids)
        return self._compiler.compile(params)

    def submit(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        return StructuredOutputRequest(params, self.executor.submit(self._compile, params))

    def grammar_bitmask(
        self, requests: list[tuple[str, StructuredOutputRequest, list[int]]]
    ) -> tuple[torch.Tensor, dict]:
        """Bitmask rows for the requests about to sample: the tokens each matcher accepts next,
        and for a request verifying drafts one row per draft position after it (the matcher
        walks the drafts, then rolls back). Returns (bitmask, req_id → first row)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(sum(1 + len(d) for _, _, d in requests), self.vocab_size)
        rows, row = {}, 0
        for req_id, so, drafts in requests:
            rows[req_id] = row
            so.matcher.fill_next_token_bitmask(bitmask, row)
            # The rows after a draft the grammar refuses stay all-allowed: the target, whose row
            # masks that draft out, rejects it for sure, and later drafts are never used.
            _walk_drafts(so.matcher, drafts, bitmask, row)
            row += 1 + len(drafts)
        return bitmask, rows

    @staticmethod
    def valid_prefix(so: StructuredOutputRequest, drafts: list[int]) -> list[int]:
        """The longest prefix of the drafts the grammar accepts (the matcher is left as it was)."""
        return drafts[: _walk_drafts(so.matcher, drafts)]

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _walk_drafts(matcher, drafts: list[int], bitmask: torch.Tensor | None = None, row: int = 0) -> int:
    """How many leading drafts the grammar accepts. With `bitmask`, fills the row after each
    accepted draft (rows row + 1, ...) with what the grammar allows next. The matcher is
    rolled back to where it was."""
    n = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        n += 1
        if bitmask is not None and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, row + n)
    if n:
        matcher.rollback(n)
    return n
