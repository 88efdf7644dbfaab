"""Request and response bodies of the Responses and Conversations APIs (pydantic v2).

Items stay plain dicts here: their many shapes are checked, with messages naming the item,
where they are turned into chat messages (responses_items.py). The response objects are
documented loosely (extra fields allowed) because the serving code builds them as JSON."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, RequestModel, SamplingRequest, TopLevelRequest

ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class ResponsesRequest(SamplingRequest):
    """POST /v1/responses: OpenAI's fields, then the vLLM sampling extras of SamplingRequest."""

    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    background: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    include: list[str] | None = None
    prompt_cache_key: str | None = Field(default=None, min_length=1)
    service_tier: ServiceTier | None = "auto"
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM extras, as for chat completions (a request's template needs --trust-request-chat-template)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ToolOutput(RequestModel):
    tool_call_id: str | None = None
    call_id: str | None = None
    output: str | list[dict[str, Any]]


class ToolOutputsRequest(TopLevelRequest):
    """POST /v1/responses/{id}/tool_outputs: one output (tool_call_id + output) or a list of them."""

    tool_call_id: str | None = None
    output: str | list[dict[str, Any]] | None = None
    tool_outputs: list[ToolOutput] | None = None


class ConversationCreateRequest(TopLevelRequest):
    items: list[dict[str, Any]] | None = Field(default=None, max_length=20)
    metadata: dict[str, str] | None = None


class ConversationUpdateRequest(TopLevelRequest):
    metadata: dict[str, str]


class ConversationItemsRequest(TopLevelRequest):
    items: list[dict[str, Any]] = Field(min_length=1, max_length=20)


# ---- responses (for the OpenAPI document; bodies are built as JSON) ---------


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None


class ToolOutputsAccepted(OpenAIBaseModel):
    id: str
    status: str
    pending_tool_calls: list[str]


class DeletedObject(OpenAIBaseModel):
    id: str
    object: str
    deleted: bool


class ItemList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class ConversationObject(OpenAIBaseModel):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str] = Field(default_factory=dict)
