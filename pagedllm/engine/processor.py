"""Front-end request processing: validate and tokenize, once, at the edge."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from pagedllm.config import ModelConfig
from pagedllm.pooling_params import PoolingParams
from pagedllm.protocol import EngineCoreRequest, MultiModalFeature
from pagedllm.sampling_params import SamplingParams, check_text

PromptType = str | list[int] | dict[str, Any]


class Processor:
    def __init__(
        self, model_config: ModelConfig, tokenizer: Any, eos_token_ids: list[int], max_n: int | None = None,
        max_embeds_per_image: int | None = None,
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_n = max_n  # None: no limit
        self.vocab_size = model_config.text_config.vocab_size
        self.mm_processor = None  # a vision-language model's, made on its first image
        self.max_embeds_per_image = max_embeds_per_image  # the scheduler's encoder budget

    def _multimodal(self, prompt: dict[str, Any]) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """A prompt dict with `multi_modal_data`: its images processed, placeholders expanded."""
        mc = self.model_config
        if not mc.is_multimodal:
            raise ValueError(f"{mc.model} ({mc.architecture}) is a text-only model: it takes no images "
                             "(multi_modal_data)")
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            kinds = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"multi_modal_data must be a dict with an 'image' entry, got {kinds}")
        images = data.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [] if images is None else [images]
        if self.mm_processor is None:
            from pagedllm.multimodal.processing import MultiModalProcessor

            self.mm_processor = MultiModalProcessor(mc.model_path, self.tokenizer, mc.hf_config.model_type,
                                                    mc.limit_mm_per_prompt, mc.mm_processor_cache_bytes,
                                                    mc.trust_remote_code)
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:  # already tokenized (a chat prompt without a second BOS)
            token_ids, features = self.mm_processor.process(None, list(prompt["prompt_token_ids"]), images)
        elif isinstance(text, str) and text:
            check_text("the prompt", text)
            token_ids, features = self.mm_processor.process(text, None, images)
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        cap = self.max_embeds_per_image
        for f in features:
            if cap is not None and f.length > cap:
                raise ValueError(f"an image of {f.length} embeddings is more than the {cap} one step computes "
                                 "(max_num_batched_tokens)")
        return text, token_ids, features

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            check_text("the prompt", prompt)
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        features = None
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            text, token_ids, features = self._multimodal(prompt)
        else:
            text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty (no tokens)")
        if params.truncate_prompt_tokens is not None and params.truncate_prompt_tokens < len(token_ids):
            if features:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        self._check_token_ids("prompt token ids", token_ids)
        max_len = self.model_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"the prompt is {len(token_ids)} tokens long; max_model_len is {max_len}, "
                "which leaves no room for output"
            )
        params = self._prepare_params(params, len(token_ids))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            mm_features=features or None,
        )
        return request, text

    def process_pooling_inputs(
        self, request_id: str, prompt: PromptType, params: PoolingParams, arrival_time: float | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """A prompt to pool: up to max_model_len tokens (after `truncate_prompt_tokens`, which
        keeps the last ones), nothing to generate."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling params must be PoolingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the input is empty (no tokens)")
        token_type_ids = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if token_type_ids is not None and (len(token_type_ids) != len(token_ids)
                                           or any(t not in (0, 1) for t in token_type_ids)):
            raise ValueError("token_type_ids must be 0 or 1 for each prompt token")
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
            if token_type_ids is not None:
                token_type_ids = token_type_ids[-params.truncate_prompt_tokens :]
        self._check_token_ids("input token ids", token_ids)
        max_len = self.model_config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"the input is {len(token_ids)} tokens long; this model's maximum is {max_len} "
                             "(truncate_prompt_tokens keeps the last tokens)")
        if params.dimensions is not None:
            text_config = self.model_config.text_config
            if not (getattr(text_config, "is_matryoshka", False)
                    or getattr(text_config, "matryoshka_dimensions", None)):
                raise ValueError(f"dimensions: {self.model_config.model} does not support matryoshka representation "
                                 "(its embeddings cannot be shortened)")
            if params.dimensions > text_config.hidden_size:
                raise ValueError(f"dimensions must be at most {text_config.hidden_size}, got {params.dimensions}")
        request = EngineCoreRequest(
            request_id=request_id, prompt_token_ids=token_ids,
            sampling_params=SamplingParams(temperature=0, max_tokens=1, detokenize=False),
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.time(), pooling_params=params,
            token_type_ids=list(token_type_ids) if token_type_ids is not None else None,
        )
        return request, text

    def _check_token_ids(self, what: str, ids) -> None:
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} out of vocabulary (size {self.vocab_size}): {bad[:5]}")

    def _prepare_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Validate against the model and fill in what needs the tokenizer; never mutates
        the caller's object."""
        if self.max_n is not None and params.best_of > self.max_n:
            # best_of >= n; the message names the field the caller set too high.
            name, value = ("n", params.n) if params.n > self.max_n else ("best_of", params.best_of)
            raise ValueError(f"{name} ({value}) is more than this engine's max_n ({self.max_n}) samples per "
                             "request; ask for fewer, or start the engine with a larger --max-n")
        if params.stop and not params.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if params.logit_bias:
            self._check_token_ids("logit_bias token ids", list(params.logit_bias))
        if params.allowed_token_ids is not None:
            self._check_token_ids("allowed_token_ids", params.allowed_token_ids)
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        if params.structured_outputs is not None:
            from pagedllm.structured_output.grammar import validate

            validate(params.structured_outputs)  # a bad schema is the caller's error, before scheduling
        params = params.clone()
        if params.max_tokens is None:
            params.max_tokens = self.model_config.max_model_len - prompt_len
        params.all_stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            params.all_stop_token_ids.update(self.eos_token_ids)
        params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        return params

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word as it would appear at the start of text and after a space."""
        seqs: list[list[int]] = []
        for word in words:
            for prefix in ("", " "):
                ids = self.tokenizer(prefix + word.lstrip(), add_special_tokens=False).input_ids
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs


def fan_out(request: EngineCoreRequest) -> list[tuple[str, EngineCoreRequest]]:
    """n / best_of > 1 → one engine-core request per sample, in one group: the scheduler
    prefills the prompt once and the other samples fork its blocks. Seeds differ per sample.
    Only sample 0 computes prompt logprobs (the parent's output reports sample 0's), so the
    others can skip the prompt."""
    params = request.sampling_params
    children = []
    for i in range(params.best_of):
        child_params = params.clone()
        child_params.n = child_params.best_of = 1
        if params.seed is not None:
            child_params.seed = params.seed + i
        if i > 0:
            child_params.prompt_logprobs = None
        if params.best_of > params.n and child_params.logprobs is None:
            child_params.logprobs = 0  # ranking needs the cumulative logprob
        child_id = f"{i}_{request.request_id}"
        children.append((child_id, replace(request, request_id=child_id, sampling_params=child_params,
                                           group_id=request.request_id)))
    return children
