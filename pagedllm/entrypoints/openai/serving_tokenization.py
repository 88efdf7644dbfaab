"""POST /tokenize and /detokenize, GET /tokenizer_info. Chat messages are rendered by the
chat server, so `count` equals the prompt_tokens a chat completion on the same messages reports."""

from __future__ import annotations

import math
import os
import re
from typing import Any

from pagedllm.entrypoints.chat_utils import default_chat_template
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import run_blocking

# Init arguments that name files or directories of the server (vocab_file, name_or_path,
# cache_dir, ...): never shown to clients.
_PATH_KEY = re.compile(r"(^|_)(file|files|dir|path|paths)$", re.IGNORECASE)
# Init arguments whose values are vocabulary strings (bos_token, additional_special_tokens, ...).
_TOKEN_KEY = re.compile(r"(_token|_tokens|added_tokens_decoder)$")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
_DROP = object()


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.tokenizer = chat.tokenizer
        self._info: dict[str, Any] | None = None

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """With images (a vision-language model), each placeholder counts as the tokens it expands
        to, as the engine will see them: the images are fetched under the media rules."""
        ids, image_sources = await run_blocking(self._tokenize, request)
        if image_sources:
            images = await self.chat.images_for(image_sources)
            try:
                ids = await run_blocking(self.chat.engine.expand_image_placeholders, ids, images)
            except ValueError as e:
                raise OpenAIError(str(e), param="messages") from None
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.chat.max_model_len, token_strs=strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        return await run_blocking(self._detokenize, request)

    def _tokenize(self, request: TokenizeRequest) -> tuple[list[int], list[Any]]:
        """The prompt's token ids (an image is its one placeholder) and the images the messages name."""
        self.chat.model_name(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give exactly one of `prompt` or `messages`", param="prompt")
        if request.prompt is not None:
            return self.chat.encode(request.prompt, request.add_special_tokens), []
        if not request.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        tools = (request.model_extra or {}).get("tools")  # vLLM's field; not (yet) in TokenizeRequest
        if tools is not None and not isinstance(tools, list):
            raise OpenAIError("tools must be a list of tools", param="tools")
        _, ids, images = self.chat.render_prompt(
            request.messages, chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs, tools=tools,
        )
        return ids, images

    def _detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.chat.model_name(request.model)
        vocab = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token ids out of vocabulary (size {vocab}): {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's init arguments (less those naming files, and
        any value holding a server path), its class, special tokens, model_max_length = the
        server's max_model_len, and the chat template chat completions use. Built once."""
        if self._info is None:
            tok = self.tokenizer
            model_config = self.chat.model_config
            hidden = _server_paths(getattr(tok, "name_or_path", None), getattr(model_config, "model_path", None),
                                   getattr(model_config, "tokenizer", None))
            config = _json_value(dict(getattr(tok, "init_kwargs", None) or {}), hidden, tokens=False)
            config.pop("chat_template", None)
            config["tokenizer_class"] = type(tok).__name__
            config["model_max_length"] = self.chat.max_model_len
            for name in _SPECIAL_TOKENS:
                value = _json_value(getattr(tok, name, None), hidden, tokens=True)
                config[name] = value if isinstance(value, str) else None
            template = self.chat.chat_template
            if template is None:
                try:
                    template = default_chat_template(tok)
                except ValueError:  # a model without a chat template
                    template = None
            if template:
                config["chat_template"] = template
            self._info = config  # TokenizerInfoResponse's fields, and the init arguments besides
        return self._info


def _server_paths(*names: str | None) -> list[str]:
    """The local paths the model and tokenizer were loaded from, as given and resolved."""
    paths: set[str] = set()
    for name in names:
        if isinstance(name, str) and name and os.path.exists(name):
            paths.update({name, os.path.abspath(name), os.path.realpath(name)})
    return sorted(paths, key=len, reverse=True)


def _looks_like_path(text: str, hidden: list[str]) -> bool:
    """Names a server path: holds the model's or tokenizer's location, or is an absolute path
    (one with a directory part, or one that exists)."""
    if any(p in text for p in hidden):
        return True
    expanded = os.path.expanduser(text) if text.startswith("~") else text
    return os.path.isabs(expanded) and (os.sep in expanded.rstrip(os.sep)[1:] or os.path.exists(expanded))


def _json_value(value: Any, hidden: list[str], tokens: bool) -> Any:
    """A JSON-safe copy of an init argument: added tokens become their text, values JSON cannot
    hold and path-like strings (outside vocabulary fields) are dropped (_DROP)."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _DROP
    if isinstance(value, str):
        return _DROP if not tokens and _looks_like_path(value, hidden) else value
    content = getattr(value, "content", None)  # tokenizers' AddedToken
    if isinstance(content, str):
        return content
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            key = str(key)
            if _PATH_KEY.search(key):
                continue
            item = _json_value(item, hidden, tokens or bool(_TOKEN_KEY.search(key)))
            if item is not _DROP:
                out[key] = item
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        return [v for v in (_json_value(item, hidden, tokens) for item in value) if v is not _DROP]
    return _DROP
