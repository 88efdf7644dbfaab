"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests mirror OpenAI's schema plus vLLM's extra sampling fields, and accept unknown
fields (OpenAI clients keep adding some); the conversion to SamplingParams lives in
serving_engine.py so this file stays a plain schema. Response models are dumped as-is.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ModelWrapValidatorHandler, field_validator, model_validator

from pagedllm.entrypoints.openai.body_checks import check_depth, check_values

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# The longest `request_id` a request may name: it becomes the engine's id, and is logged and echoed.
MAX_REQUEST_ID_CHARS = 256

# A token id: a JSON integer, never "5", 5.0 or true (the vocabulary bound is checked by the server).
TokenId = Annotated[int, Field(strict=True, ge=0)]

# Roles a chat message may have (chat_utils.ALLOWED_ROLES, plus OpenAI's "developer", taken as "system").
ChatRole = Literal["system", "user", "assistant", "tool", "developer"]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class RequestModel(OpenAIBaseModel):
    """A request body or a part of one. Strict, as OpenAI's API is: "5" is not an integer nor
    1 a boolean (an integer is still a float); NaN and ±Infinity are not numbers a request
    may carry."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class TopLevelRequest(RequestModel):
    """A whole request body. Python's json module accepts lone surrogates ("\\ud800") and NaN /
    Infinity, which tokenizers and samplers then choke on, and any nesting depth, which every
    recursive walk after it would choke on; rejected here, anywhere in the body, unknown fields
    and free-form objects (tools, response_format) included (body_checks.py)."""

    @model_validator(mode="wrap")
    @classmethod
    def _reject_invalid_values(cls, data: Any, handler: ModelWrapValidatorHandler) -> Any:
        if not isinstance(data, BaseModel):
            check_depth(data)  # before anything walks it
        model = handler(data)  # typed fields next: their errors name the field precisely
        if not isinstance(data, BaseModel):
            check_values(data)
        return model


# ---- errors ---------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- requests -------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingRequest(TopLevelRequest):
    """Fields shared by chat and text completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    prompt_logprobs: int | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    echo: bool = False
    priority: int = 0
    request_id: str | None = Field(default=None, max_length=MAX_REQUEST_ID_CHARS)
    cache_salt: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Structured outputs: vLLM's `structured_outputs` object and the legacy guided_* fields.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = None


class ChatMessageParam(RequestModel):
    """One message; content parts are checked by chat_utils (only text is supported)."""

    role: ChatRole
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        """OpenAI's newer name for the system role; chat templates know only "system"."""
        return "system" if role == "developer" else role


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    best_of: int | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True


class TokenizeRequest(TopLevelRequest):
    """Either `prompt` (text) or `messages` (rendered with the chat template first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(TopLevelRequest):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses ------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


def random_tool_call_id() -> str:
    """OpenAI-style id (`call_` + 24 hex chars): unique per call so clients can pair results with calls."""
    return f"call_{uuid.uuid4().hex[:24]}"


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON string, as OpenAI clients expect


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=random_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall = Field(default_factory=DeltaFunctionCall)


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class TokenizerInfoResponse(OpenAIBaseModel):
    """GET /tokenizer_info (with --enable-tokenizer-info-endpoint), as vLLM's: the tokenizer's
    configuration (its init arguments, less anything naming a file) and these fields."""

    tokenizer_class: str
    model_max_length: int  # the server's max_model_len
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None  # the one chat completions use, if any
