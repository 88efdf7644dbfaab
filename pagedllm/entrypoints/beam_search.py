"""Beam search on top of `LLM.generate`, in the style of vLLM's `LLM.beam_search`.

The engine itself only samples; beam search is driven from outside, one token per step: every live
beam of every prompt becomes a one-token request asking for its top `2 * beam_width` logprobs, and
all of them go to the engine in a single `generate` call so they are batched together. Beams are
resubmitted as whole token sequences each step; prefix caching (on by default) makes that cheap,
since beams share their prompt and common history as cached KV blocks, and only the uncached tail
(at most one partial block plus the new token) is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.engine.logprobs import Logprob
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.processor import PromptType
    from pagedllm.outputs import RequestOutput


class Generator(Protocol):
    """What beam search needs of `LLM`: its engine, its tokenizer and batched `generate`."""

    llm_engine: LLMEngine

    def get_tokenizer(self) -> Any: ...

    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: bool = True) -> list[RequestOutput]: ...


@dataclass
class BeamSearchSequence:
    """One hypothesis. `tokens` is prompt + generated; `logprobs[i]` is the engine's top-k dict at
    generated position i; `score` is filled in for returned sequences."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length" (max_tokens / max_model_len)
    num_prompt_tokens: int = 0
    score: float | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(seq: BeamSearchSequence, length_penalty: float) -> float:
    """cum_logprob / generated_len ** length_penalty, with generated_len counting every generated
    token, a final EOS included. That is transformers' (>= 4.50) convention and gives exactly its
    `sequences_scores`; vLLM instead counts prompt tokens too and drops a final EOS, which changes
    the scores and, with length_penalty != 0, can reorder sequences of different lengths."""
    return seq.cum_logprob / (max(len(seq.output_token_ids), 1) ** length_penalty)


@dataclass
class _Instance:
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def _prompt_token_ids(tokenizer: Any, prompt: PromptType) -> list[int]:
    """Token ids as the engine's Processor would make them (the tokenizer's own special tokens)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" not in prompt:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        return list(tokenizer(prompt).input_ids)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _finalize(inst: _Instance, params: BeamSearchParams, eos_ids: set[int], tokenizer: Any) -> BeamSearchOutput:
    """Best `beam_width` of completed + live beams, scored and detokenized."""
    for beam in inst.beams:
        beam.finish_reason = beam.finish_reason or "length"
    pool = inst.completed + inst.beams
    for seq in pool:
        seq.score = get_beam_search_score(seq, params.length_penalty)
    best = sorted(pool, key=lambda s: s.score, reverse=True)[: params.beam_width]
    for seq in best:
        out = seq.output_token_ids
        ends_in_eos = seq.finish_reason == "stop" and bool(out) and out[-1] in eos_ids
        body = out[:-1] if ends_in_eos else out
        seq.text = tokenizer.decode(body, skip_special_tokens=True)
        if ends_in_eos and params.include_stop_str_in_output:
            seq.text += tokenizer.decode(out[-1:], skip_special_tokens=False)
    return BeamSearchOutput(best)


def run_beam_search(
    llm: Generator, prompts: Sequence[PromptType] | PromptType, params: BeamSearchParams
) -> list[BeamSearchOutput]:
    """Beam search for each prompt; one `BeamSearchOutput` per prompt, in order.

    Each step expands every live beam with its top `2 * beam_width` next tokens (as transformers
    does, so that `beam_width` non-EOS candidates always survive). A candidate ending in EOS (unless
    `ignore_eos`) is moved to the prompt's completed list, the rest compete for the `beam_width`
    live slots. Beams that reach max_model_len stop there. All live beams of all prompts are one
    batched `generate` call per step; the engine holds no KV blocks between steps except what the
    prefix cache keeps as reusable (free) blocks.
    """
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    eos_ids = set(engine.processor.eos_token_ids)
    max_len = engine.config.model_config.max_model_len
    step_params = SamplingParams(
        max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature, ignore_eos=True
    )

    instances = []
    for prompt in prompts:
        ids = _prompt_token_ids(tokenizer, prompt)
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if len(ids) >= max_len:
            raise ValueError(f"the prompt is {len(ids)} tokens long; max_model_len is {max_len}")
        instances.append(_Instance([BeamSearchSequence(ids, num_prompt_tokens=len(ids))]))

    for _ in range(params.max_tokens):
        for inst in instances:  # no room for another token: done, as the engine would say "length"
            for beam in inst.beams:
                if len(beam.tokens) >= max_len:
                    beam.finish_reason = "length"
                    inst.completed.append(beam)
            inst.beams = [b for b in inst.beams if b.finish_reason is None]
        batch = [beam for inst in instances for beam in inst.beams]
        if not batch:
            break
        results = iter(llm.generate([b.tokens for b in batch], step_params, use_tqdm=False))
        for inst in instances:
            candidates: list[BeamSearchSequence] = []
            for beam in inst.beams:
                step_logprobs = next(results).outputs[0].logprobs
                top = step_logprobs[0] if step_logprobs else {}
                for tok, lp in top.items():
                    new = BeamSearchSequence(
                        beam.tokens + [tok], beam.logprobs + [top], beam.cum_logprob + lp.logprob,
                        num_prompt_tokens=beam.num_prompt_tokens,
                    )
                    if tok in eos_ids and not params.ignore_eos:
                        new.finish_reason = "stop"
                        inst.completed.append(new)
                    else:
                        candidates.append(new)
            candidates.sort(key=lambda s: get_beam_search_score(s, params.length_penalty), reverse=True)
            inst.beams = candidates[: params.beam_width]

    return [_finalize(inst, params, eos_ids, tokenizer) for inst in instances]
