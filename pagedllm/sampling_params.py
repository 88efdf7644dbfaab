"""Per-request sampling parameters: vLLM's names, defaults and meanings, importable from where
vLLM has them (`SamplingParams`, `StructuredOutputsParams`, `BeamSearchParams`,
`RequestOutputKind`)."""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

_GREEDY_EPS = 1e-5
# How many top logprobs a request may ask for (vLLM's --max-logprobs default).
MAX_LOGPROBS = 20

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
_INT_FIELDS = ("min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens", "seed")


def check_text(name: str, text: Any) -> None:
    """A string the tokenizer can take: a lone surrogate (e.g. from a JSON "\\ud800" escape)
    is not valid Unicode text and makes the tokenizer raise TypeError."""
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text (lone surrogate U+{ord(text[e.start]):04X} "
                         f"at {e.start})") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


LogitsProcessor = (
    Callable[[list[int], torch.Tensor], torch.Tensor]
    | Callable[[list[int], list[int], torch.Tensor], torch.Tensor]
)


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, a choice of strings, an EBNF/GBNF
    grammar, any JSON object or an xgrammar structural tag. Exactly one of them."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    # JSON only: no free whitespace between tokens (compact JSON; a weak model cannot ramble).
    disable_any_whitespace: bool = False
    # JSON only: xgrammar's own grammar, without pagedllm's bounds on whitespace and digits
    # (structured_output/grammar.py), for a model that needs the room.
    unbounded: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; got {given or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("disable_any_whitespace", "unbounded"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {getattr(self, name)!r}")

    def key(self) -> tuple[str, str]:
        """(kind, spec) — the cache key of the compiled grammar."""
        import json as _json

        if self.json is not None:
            # Not sort_keys: the grammar emits properties in the schema's order, as the caller wrote it.
            spec = self.json if isinstance(self.json, str) else _json.dumps(self.json)
            return "json", spec
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        if self.structural_tag is not None:
            tag = self.structural_tag
            return "structural_tag", tag if isinstance(tag, str) else _json.dumps(tag)
        return "json_object", ""


class RequestOutputKind(enum.IntEnum):
    """What each of a request's outputs carries: everything so far (CUMULATIVE), only what is
    new since the previous one (DELTA: streaming, without a per-step copy of the whole output),
    or one output at the end (FINAL_ONLY)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Callables cannot cross a process boundary: offline (LLM / LLMEngine) only.
    logits_processors: list[Any] | None = None
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled in by the processor: stop ids that min_tokens must hold back (EOS + stop_token_ids).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled in by the processor: token-id sequences for `bad_words`.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be one of {[k.name for k in RequestOutputKind]}, "
                             f"got {self.output_kind!r}") from None
        self._verify()
        # Union, not assignment: a decoded copy (msgspec runs __post_init__) keeps its EOS ids.
        self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)

    def _verify(self) -> None:
        # Types and finiteness first: NaN passes every comparison below unnoticed (a NaN
        # temperature would sample garbage), and a string would raise TypeError instead.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if (value is not None or name == "min_tokens") and not (
                _is_int(value) and _INT64_MIN <= value <= _INT64_MAX
            ):
                raise ValueError(f"{name} must be a 64-bit integer, got {value!r}")
        if self.logit_bias and not all(math.isfinite(v) for v in self.logit_bias.values()):
            raise ValueError(f"logit_bias values must be finite numbers, got {self.logit_bias}")
        for name in ("stop", "bad_words"):
            for i, text in enumerate(getattr(self, name)):
                check_text(f"{name}: entry {i}", text)
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.best_of > 1 and self.greedy:
            raise ValueError("best_of > 1 requires sampling (temperature > 0): greedy samples would be identical")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_output_history(self) -> bool:
        """Whether the sampler needs the request's token history (penalties, processors)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logits_processors)
        )

    def clone(self) -> SamplingParams:
        """A copy whose containers can be changed without touching this one. One level deep only:
        a structured-output schema is shared, read-only, never walked (a request may nest one
        hundreds deep), and logits processors (which may hold large state) are shared too."""
        new = copy.copy(self)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (list, dict, set)) and f.name != "logits_processors":
                setattr(new, f.name, copy.copy(value))
        if self.structured_outputs is not None:
            new.structured_outputs = copy.copy(self.structured_outputs)
        return new


@dataclass
class BeamSearchParams:
    """vLLM's names. `temperature` only matters for the token the engine samples, which beam search
    ignores: candidates come from the (unscaled) top-k logprobs."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if 2 * self.beam_width > MAX_LOGPROBS:  # each step asks the engine for 2 * beam_width logprobs
            raise ValueError(f"beam_width must be at most {MAX_LOGPROBS // 2}, got {self.beam_width}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
