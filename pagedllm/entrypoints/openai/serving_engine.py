"""What chat and text completions share: the served-model check,
request → SamplingParams, the context-length check, and the engine call wrapped with
metrics and a guaranteed abort (a request that stops being read must free its blocks)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import SamplingRequest
from pagedllm.entrypoints.openai.request_logger import RequestLogger
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Template rendering, tokenization and long detokenization run here, off the event loop, so
# one costly request never stalls /health or the streams of others. Shared by every route:
# the tokenizer is used from these threads and the loop at once, read-only.
_PREP_WORKERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pagedllm-prep")

def random_id() -> str:
    return uuid.uuid4().hex


async def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run CPU-bound request preparation in the worker threads and await it."""
    return await asyncio.get_running_loop().run_in_executor(_PREP_WORKERS, functools.partial(fn, *args, **kwargs))


_MAX_CHARS: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()  # (len, longest)


def max_chars_per_token(tokenizer: Any) -> int:
    """The longest vocabulary entry, in characters: no token covers more text than that, so a
    text longer than `limit * this` holds more than `limit` tokens (a cheap pre-tokenization
    guard). Byte-level entries spell a multi-byte character with several characters, which
    keeps the bound safe. Measured once per tokenizer and vocabulary size: every serving class
    asks."""
    try:
        vocab = len(tokenizer)
        with contextlib.suppress(KeyError, TypeError):
            size, longest = _MAX_CHARS[tokenizer]
            if size == vocab:
                return longest
        tokens = tokenizer.convert_ids_to_tokens(list(range(vocab)))
        longest = max((len(t) for t in tokens if isinstance(t, str)), default=1) or 1
    except Exception:  # an unusual tokenizer: a generous fixed bound
        logger.debug("could not measure the vocabulary's longest token", exc_info=True)
        return 64
    with contextlib.suppress(TypeError):  # not weakly referable: measured again next time
        _MAX_CHARS[tokenizer] = (vocab, longest)
    return longest


def vocab_size(model_config: Any, tokenizer: Any) -> int:
    """The model's vocabulary (what the engine accepts), else the tokenizer's: its length (added
    tokens included), or its `vocab_size` for one without a length. A clear error at start-up
    where neither says."""
    for size in (getattr(getattr(model_config, "text_config", None), "vocab_size", None),
                 _length(tokenizer), getattr(tokenizer, "vocab_size", None)):
        if isinstance(size, int) and size > 0:
            return size
    raise ValueError("cannot tell the vocabulary size: the model config has no valid vocab_size, and the tokenizer "
                     "neither a length nor a vocab_size")


def _length(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except TypeError:
        return None


def _generation_defaults(model_path: str) -> dict[str, Any]:
    """Sampling defaults the model's generation_config.json sets (as vLLM applies them):
    a request that omits temperature gets the model author's choice, not 1.0."""
    try:
        from transformers import GenerationConfig

        diff = GenerationConfig.from_pretrained(model_path).to_diff_dict()
    except Exception:  # no or unreadable generation_config: plain OpenAI defaults
        return {}
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: diff[k] for k in keys if diff.get(k) is not None}


class OpenAIServing:
    request_logger: RequestLogger | None = None  # --enable-log-requests: build_app sets one

    def __init__(
        self, engine: EngineClient, models: OpenAIServingModels | list[str], metrics: ServerMetrics | None = None
    ) -> None:
        """`models`: the server's shared registry of names (base and LoRA), or just base names."""
        if isinstance(models, list):
            models = OpenAIServingModels(engine, models)
        self.models = models
        self.engine = engine
        self.tokenizer = engine.get_tokenizer()
        self.model_config = engine.model_config
        self.max_model_len: int = engine.model_config.max_model_len
        self.vocab_size = vocab_size(engine.model_config, self.tokenizer)
        # Normalisation may shrink text (NFKC, whitespace): a 4x margin on the bound.
        self.max_prompt_chars = 4 * (self.max_model_len + 16) * max_chars_per_token(self.tokenizer)
        self.served_model_names = models.base_model_names
        self.metrics = metrics
        self.default_sampling = _generation_defaults(getattr(engine.model_config, "model_path", ""))
        if self.default_sampling:
            logger.info("sampling defaults from the model's generation_config: %s", self.default_sampling)

    # ---- checks -----------------------------------------------------------
    def check_generation_runner(self) -> None:
        if getattr(self.model_config, "runner", "generate") == "pooling":
            raise OpenAIError("This server runs a pooling (embedding) model, which does not generate text; start a "
                              "generation server for completions: pagedllm serve MODEL (--runner generate)",
                              param="model")

    def model_name(self, requested: str | None) -> str:
        """The name to answer with (a LoRA adapter's too); an unknown name is a 404 as in OpenAI's API."""
        return self.models.model_name(requested)

    def check_length(self, prompt_len: int, max_tokens: int | None, prompt_param: str = "prompt") -> None:
        """Prompt plus completion must fit max_model_len; caught here, with a clear message."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt is "
                f"{prompt_len} tokens long, which leaves no room for the completion. Please shorten the prompt.",
                param=prompt_param,
            )
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.",
                param="max_tokens",
            )

    @staticmethod
    def check_common(request: SamplingRequest) -> None:
        if request.use_beam_search:
            raise OpenAIError("use_beam_search is not supported by this server", param="use_beam_search")
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options can only be set when stream is true", param="stream_options")

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        """Token ids must be in the model's vocabulary; the tokenizer's decode would
        otherwise fail on ids beyond 32 bits (OverflowError) before the engine saw them."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(f"{param}: token ids out of vocabulary (size {self.vocab_size}): {bad[:5]}",
                              param=param)

    def check_text_length(self, text: str, param: str = "prompt") -> None:
        """Reject, before tokenizing it, a text that cannot fit max_model_len tokens."""
        if len(text) > self.max_prompt_chars:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens; a text of {len(text)} "
                "characters cannot fit it. Please shorten the prompt.", param=param,
            )

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_text_length(text, param)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    # ---- request → SamplingParams ----------------------------------------
    def sampling_params(
        self,
        request: SamplingRequest,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        best_of: int | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> SamplingParams:
        """`output_kind`: DELTA for a stream (each output carries only what is new); a single
        answer keeps CUMULATIVE, so the metrics still see every step (inter-token latency)."""
        defaults = self.default_sampling

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(request, name)
            return value if value is not None else defaults.get(name, fallback)

        logit_bias = None
        if request.logit_bias:
            # OpenAI's keys are token ids as strings; values are clamped to its [-100, 100]
            # (at most 20 digits: int() refuses strings over 4300 digits with a ValueError)
            if not all(k.isascii() and k.isdigit() and len(k) <= 20 for k in request.logit_bias):
                raise OpenAIError("logit_bias keys must be token ids (non-negative integers)", param="logit_bias")
            logit_bias = {int(k): max(-100.0, min(100.0, float(v))) for k, v in request.logit_bias.items()}
            self.check_token_ids(list(logit_bias), "logit_bias")
        for name in ("stop_token_ids", "allowed_token_ids"):
            self.check_token_ids(getattr(request, name) or [], name)
        try:
            return SamplingParams(
                n=request.n if request.n is not None else 1,
                best_of=best_of,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=pick("repetition_penalty", 1.0),
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                truncate_prompt_tokens=request.truncate_prompt_tokens,
                logit_bias=logit_bias,
                allowed_token_ids=request.allowed_token_ids,
                bad_words=request.bad_words,
                structured_outputs=structured_outputs_of(request),
                output_kind=output_kind,
            )
        except ValueError as e:
            raise OpenAIError(str(e), param=_param_of(str(e), request)) from None

    # ---- the engine call --------------------------------------------------
    async def generate(
        self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str, request: SamplingRequest
    ) -> AsyncIterator[RequestOutput]:
        """engine.generate with metrics; however this generator ends early (closed,
        cancelled, failed), the engine request is aborted."""
        tracker = self.metrics.track(params) if self.metrics is not None else None
        if self.engine.errored:
            raise EngineDeadError()
        lora_request = self.models.lora_request(request.model)
        if self.request_logger is not None:
            self.request_logger.log_inputs(request_id, prompt, params, lora_request)
        gen = self.engine.generate(prompt, params, request_id, priority=request.priority,
                                   cache_salt=request.cache_salt, lora_request=lora_request)
        finished = rejected = started = False
        try:
            try:
                async for out in gen:
                    started = True
                    finished = out.finished
                    if tracker is not None:
                        tracker.update(out)
                    yield out
            except ValueError as e:  # the engine's own validation: the client's fault
                rejected = True
                raise OpenAIError(str(e), param=_param_of(str(e), request)) from None
        finally:
            if not finished:
                await _close_quietly(gen)
                if not rejected:  # (a rejected duplicate id must not abort the other request)
                    await self.abort(request_id)
                if started and tracker is not None:
                    tracker.aborted()

    async def abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # already finished or engine gone: nothing left to free
            logger.debug("abort of %s failed", request_id, exc_info=True)


async def _close_quietly(gen: Any) -> None:
    try:
        await gen.aclose()
    except RuntimeError:  # "already running": its task was cancelled and unwinds by itself
        pass
    except Exception:
        logger.debug("closing an engine stream failed", exc_info=True)


def _param_of(message: str, request: SamplingRequest) -> str | None:
    """SamplingParams' messages start with the offending field's name; report it as `param`."""
    word = message.split(" ", 1)[0].strip(":,")
    return word if word in type(request).model_fields else None


_SO_OPTIONS = ("disable_any_whitespace", "unbounded")


def structured_outputs_of(request: SamplingRequest) -> StructuredOutputsParams | None:
    """One constraint from `structured_outputs`, `response_format` or a legacy guided_* field.
    A `structured_outputs` object holding only options (disable_any_whitespace, unbounded)
    applies them to the constraint given by response_format or guided_*, as vLLM merges them."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    so = request.structured_outputs
    options: dict[str, Any] = {}
    if so and set(so) <= set(_SO_OPTIONS):
        options = so
    elif so is not None:
        try:
            found.append(("structured_outputs", StructuredOutputsParams(**so)))
        except TypeError as e:
            raise OpenAIError(f"structured_outputs: {e}", param="structured_outputs") from None
    fmt = request.response_format or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        found.append(("response_format", StructuredOutputsParams(json_object=True)))
    elif kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, (dict, str)):
            raise OpenAIError("response_format.json_schema.schema must be a JSON schema", param="response_format")
        found.append(("response_format", StructuredOutputsParams(json=schema)))
    elif kind == "structural_tag":  # xgrammar's {"format": ...} or vLLM's older {"structures", "triggers"}
        found.append(("response_format", StructuredOutputsParams(structural_tag=fmt)))
    elif kind != "text":
        raise OpenAIError(f"response_format type {kind!r} is not supported", param="response_format")
    for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            found.append((name, StructuredOutputsParams(**{field: value})))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise OpenAIError(f"give only one structured-output constraint, got {names}", param=found[1][0])
    if options:
        if not found:
            raise OpenAIError(f"structured_outputs with only {', '.join(options)} needs a constraint: "
                              "response_format, guided_* or one of json, regex, choice, grammar, json_object, "
                              "structural_tag", param="structured_outputs")
        found[0] = (found[0][0], StructuredOutputsParams(**{**_fields(found[0][1]), **options}))
    return found[0][1] if found else None


def _fields(params: StructuredOutputsParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
