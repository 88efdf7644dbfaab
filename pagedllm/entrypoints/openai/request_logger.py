"""`--enable-log-requests`: one INFO line per generation request as it reaches the engine, as
vLLM's RequestLogger; `--max-log-len` cuts the prompt text (characters) and its token ids."""

from __future__ import annotations

import logging
from typing import Any

from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestLogger:
    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log_inputs(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams,
                   lora_request: LoRARequest | None = None) -> None:
        text, ids = _split(prompt)
        num_tokens = len(ids) if ids is not None else None
        if self.max_log_len is not None:
            text = text[: self.max_log_len] if text is not None else None
            ids = ids[: self.max_log_len] if ids is not None else None
        logger.info("Received request %s: prompt length %s tokens, params: %s, prompt: %r, prompt_token_ids: %s, "
                    "lora_request: %s", request_id, num_tokens if num_tokens is not None else "?", params, text, ids,
                    lora_request.lora_name if lora_request is not None else None)


def _split(prompt: Any) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a prompt in any of the engine's shapes."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return prompt.get("prompt"), list(ids) if ids is not None else None
    return None, list(prompt)
