"""Request and response bodies of the pooling routes (/v1/embeddings), in OpenAI's and vLLM's
shapes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, TokenId, TopLevelRequest


class EmbeddingRequest(TopLevelRequest):
    model: str | None = None
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    normalize: bool | None = None


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format=base64


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
