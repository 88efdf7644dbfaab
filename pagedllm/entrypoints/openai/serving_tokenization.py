"""POST /tokenize and /detokenize. Chat messages are rendered by the chat server, so
`count` equals the prompt_tokens a chat completion on the same messages reports."""

from __future__ import annotations

from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, run_blocking


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.tokenizer = chat.tokenizer

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        return await run_blocking(self._tokenize, request)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        return await run_blocking(self._detokenize, request)

    def _tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.chat.model_name(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give exactly one of `prompt` or `messages`", param="prompt")
        if request.prompt is not None:
            ids = self.chat.encode(request.prompt, request.add_special_tokens)
        else:
            if not request.messages:
                raise OpenAIError("messages must not be empty", param="messages")
            _, ids = self.chat.render(
                request.messages, chat_template=request.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs,
            )
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.chat.max_model_len, token_strs=strs)

    def _detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.chat.model_name(request.model)
        vocab = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token ids out of vocabulary (size {vocab}): {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
