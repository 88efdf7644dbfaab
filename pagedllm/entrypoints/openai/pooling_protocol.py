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


class ScoreRequest(TopLevelRequest):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)


class ScoreData(OpenAIBaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocumentIn(TopLevelRequest):
    text: str


class RerankRequest(TopLevelRequest):
    """Jina's and Cohere's shape: a query, documents, the top_n most relevant back."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocumentIn]
    top_n: int | None = Field(default=None, ge=0)  # None or 0: all
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the raw pooled hidden states (not normalized unless asked)."""


class PoolingData(OpenAIBaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage


class ClassificationRequest(TopLevelRequest):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    user: str | None = None


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: EmbeddingUsage
