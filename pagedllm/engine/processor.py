"""Front-end request processing: validate and tokenize, once, at the edge."""

from __future__ import annotations

import time
from typing import Any

from pagedllm.config import ModelConfig
from pagedllm.core.request import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class Processor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model_config.text_config.vocab_size

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
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty (no tokens)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary (size {self.vocab_size}): {bad[:5]}")
        max_len = self.model_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"the prompt is {len(token_ids)} tokens long; max_model_len is {max_len}, "
                "which leaves no room for output"
            )
        if params.max_tokens is None:
            params = params.clone()
            params.max_tokens = max_len - len(token_ids)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
        )
        return request, text
