"""POST /score and /rerank (with their /v1/ and /v2/ aliases) on an embedding model: the cosine
similarity of the texts' embeddings, each distinct text embedded once."""

from __future__ import annotations

import time
import uuid

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.pooling_protocol import (
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_engine import run_blocking
from pagedllm.pooling_params import PoolingParams, cosine, cross_encoder_prompt, pair_up


class OpenAIServingScore(OpenAIServingEmbedding):
    async def _similarities(self, firsts: list[str], seconds: list[str], truncate: int | None,
                            param: str) -> tuple[list[float], int]:
        """Cosine of each (first, second) pair, and the tokens embedded; a cross-encoder's score of
        each pair read at once."""
        if getattr(self.model_config, "classify", False):
            return await self._cross_encode(firsts, seconds, truncate, param)
        texts = list(dict.fromkeys(firsts + seconds))
        prompts = await run_blocking(self._prompts, texts, truncate, param)
        outs = await self.embed(prompts, PoolingParams(normalize=True, truncate_prompt_tokens=truncate), "score")
        vectors = {t: o.outputs.data for t, o in zip(texts, outs)}
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return [cosine(vectors[a], vectors[b]) for a, b in zip(firsts, seconds)], tokens

    async def _cross_encode(self, firsts: list[str], seconds: list[str], truncate: int | None,
                            param: str) -> tuple[list[float], int]:
        if self.model_config.hf_config.num_labels != 1:
            raise OpenAIError("score needs an embedding model or a cross-encoder (a classifier with one label)",
                              param="model")

        def tokenize() -> list[dict]:
            prompts = [cross_encoder_prompt(self.tokenizer, a, b) for a, b in zip(firsts, seconds)]
            for p in prompts:
                if len(p["prompt_token_ids"]) > self.max_model_len and truncate is None:
                    raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens; a pair "
                                      f"is {len(p['prompt_token_ids'])}. Set truncate_prompt_tokens.", param=param)
            return prompts

        prompts = await run_blocking(tokenize)
        outs = await self.embed(prompts, PoolingParams(normalize=False, truncate_prompt_tokens=truncate,
                                                       task="classify"), "score")
        return [o.outputs.data[0] for o in outs], sum(len(o.prompt_token_ids) for o in outs)

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        self.check_pooling_runner()
        model = self.model_name(request.model)
        as_list = (lambda t: [t] if isinstance(t, str) else list(t))
        try:
            firsts, seconds = pair_up(as_list(request.text_1), as_list(request.text_2))
        except ValueError as e:
            raise OpenAIError(str(e), param="text_1") from None
        scores, tokens = await self._similarities(firsts, seconds, request.truncate_prompt_tokens, "text_2")
        return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def rerank(self, request: RerankRequest) -> RerankResponse:
        self.check_pooling_runner()
        model = self.model_name(request.model)
        docs = [d if isinstance(d, str) else d.text for d in request.documents]
        if not docs:
            raise OpenAIError("documents must not be empty", param="documents")
        scores, tokens = await self._similarities([request.query] * len(docs), docs, request.truncate_prompt_tokens,
                                                  "documents")
        order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
        if request.top_n:
            order = order[: request.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=docs[i]) if request.return_documents else None)
                   for i in order]
        return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, usage=RerankUsage(total_tokens=tokens),
                              results=results)
