"""Engine-core side of structured outputs: compile grammars off the busy loop (in child
processes, with a time limit: compile_pool.py), keep one matcher per request, build the step's
token bitmask, advance matchers on accepted tokens. With a reasoning parser, a request's
grammar starts only once its reasoning has ended (reasoner.py)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import ModelConfig
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.compile_pool import CompilePool, Ticket
from pagedllm.structured_output.grammar import kind_of, message, recipe
from pagedllm.structured_output.limits import env_timeout_s, env_workers
from pagedllm.structured_output.reasoner import Reasoner

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StructuredOutputRequest:
    params: StructuredOutputsParams
    future: Future  # of StructuredOutputManager._compile: (ticket, reasoner, reasoning ended)
    ticket: Ticket | None = None
    matcher: Any = None
    error: str | None = None
    # The engine's reasoning tags (None: no reasoning parser), and whether this request's
    # reasoning is over, so that its tokens go to the grammar.
    reasoner: Reasoner | None = None
    reasoning_ended: bool = True

    def ready(self) -> bool:
        """True once compiled (matcher built) or failed (error set)."""
        if self.matcher is not None or self.error is not None:
            return True
        try:
            if self.ticket is None:
                if not self.future.done():
                    return False
                self.ticket, self.reasoner, self.reasoning_ended = self.future.result()
            if not self.ticket.done():
                return False
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.ticket.result())
        except Exception as e:
            self.error = str(e)
        return True

    def cancel(self) -> None:
        """The request is gone: its compile is dropped, or its process killed, unless another
        request shares it."""
        if self.ticket is not None:
            self.ticket.release()
        elif not self.future.cancel():
            self.future.add_done_callback(_release_ticket)

    def accept_token(self, token: int) -> bool:
        """Advance on one output token; False if the grammar refuses it or is complete after it.
        Tokens up to and including the end of the reasoning are not the grammar's."""
        if not self.reasoning_ended:
            self.reasoning_ended = token == self.reasoner.end_token_id
            return True
        return self.matcher.accept_token(token) and not self.matcher.is_terminated()


def _release_ticket(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result()[0].release()


class GrammarCompiler:
    """One per engine: the tokenizer info, built once (about a second for a 262k vocabulary),
    and the compiler processes."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], workers: int,
                 timeout_s: float) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.pool = CompilePool(info, workers, timeout_s)

    def compile(self, params: StructuredOutputsParams) -> Ticket:
        """A ticket for the compiled grammar; ValueError at once if the spec is refused."""
        kind = kind_of(params)
        try:
            what, args, kwargs = recipe(params)
        except Exception as e:
            raise ValueError(message(kind, e)) from None
        key = (what, repr(args), repr(sorted(kwargs.items())))
        return self.pool.submit(key, f"structured_outputs.{kind}", (what, args, kwargs))

    def close(self) -> None:
        self.pool.close()


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig, reasoning_parser: str | None = None) -> None:
        self.model_config = model_config
        self.reasoning_parser = reasoning_parser
        self.vocab_size = model_config.text_config.vocab_size
        self.compile_workers = env_workers()
        self.compile_timeout_s = env_timeout_s()
        # Threads only load the tokenizer (once) and hand recipes to the compiler processes.
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self._setup_lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        self._reasoner: Reasoner | None = None

    def _setup(self) -> GrammarCompiler:
        with self._setup_lock:
            if self._compiler is None:  # the tokenizer is needed only once a grammar request arrives
                from pagedllm.transformers_utils.tokenizer import get_eos_token_ids, get_tokenizer

                mc = self.model_config
                tokenizer = get_tokenizer(mc.tokenizer, mc.trust_remote_code)
                stop_ids = get_eos_token_ids(mc.model_path, tokenizer)
                if self.reasoning_parser is not None:
                    self._reasoner = Reasoner.from_tokenizer(self.reasoning_parser, tokenizer)
                self._compiler = GrammarCompiler(tokenizer, self.vocab_size, stop_ids, self.compile_workers,
                                                 self.compile_timeout_s)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams, prompt_token_ids: list[int]) -> tuple:
        """(ticket of the compiled grammar, reasoner, whether the prompt already ended the reasoning)."""
        compiler = self._setup()
        reasoner = self._reasoner
        ended = reasoner is None or reasoner.is_reasoning_end(prompt_token_ids)
        return compiler.compile(params), reasoner, ended

    def submit(self, params: StructuredOutputsParams, prompt_token_ids: list[int]) -> StructuredOutputRequest:
        return StructuredOutputRequest(params, self.executor.submit(self._compile, params, prompt_token_ids))

    def grammar_bitmask(
        self, requests: list[tuple[str, StructuredOutputRequest, list[int]]]
    ) -> tuple[torch.Tensor, dict] | None:
        """Bitmask rows for the requests about to sample whose grammar has started: the tokens
        each matcher accepts next, and for a request verifying drafts one row per draft position
        after it (the matcher walks the drafts, then rolls back). Returns (bitmask, req_id →
        first row), or None when no request needs one."""
        import xgrammar as xgr

        requests = [r for r in requests if r[1].reasoning_ended]
        if not requests:
            return None
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
        """The longest prefix of the drafts the grammar accepts (the matcher is left as it was).
        While reasoning, drafts run up to the end of the reasoning and not past it: the rows
        after it would have had no mask."""
        if not so.reasoning_ended:
            end = so.reasoner.end_token_id
            return drafts[: drafts.index(end) + 1] if end in drafts else drafts
        return drafts[: _walk_drafts(so.matcher, drafts)]

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:
            self._compiler.close()


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
