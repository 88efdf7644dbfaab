"""POST /v1/embeddings: each input pooled by the engine (all of them at once, batched by the
scheduler), as floats or base64 float32."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import numpy as np

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.pooling_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, run_blocking
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

POOLING_SERVER_HINT = ("start a pooling server for embeddings: pagedllm serve MODEL --runner pooling "
                       "(with no MODEL, the default embedding model all-MiniLM-L6-v2)")


class OpenAIServingEmbedding(OpenAIServing):
    def check_pooling_runner(self) -> None:
        if getattr(self.model_config, "runner", "generate") != "pooling":
            raise OpenAIError(f"This server runs a generation model, which does not embed; {POOLING_SERVER_HINT}",
                              param="model")

    async def create(self, request: EmbeddingRequest) -> EmbeddingResponse:
        self.check_pooling_runner()
        model = self.model_name(request.model)
        prompts = await run_blocking(self._prompts, request.input, request.truncate_prompt_tokens)
        params = PoolingParams(normalize=request.normalize, dimensions=request.dimensions,
                               truncate_prompt_tokens=request.truncate_prompt_tokens)
        outs = await self.embed(prompts, params, "embd")
        data = [EmbeddingData(index=i, embedding=_encode_vector(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outs)]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse(data=data, model=model, usage=usage)

    async def pooling(self, request: PoolingRequest) -> PoolingResponse:
        """The pooled hidden states as they come out of the pooler: normalized only if asked."""
        self.check_pooling_runner()
        model = self.model_name(request.model)
        prompts = await run_blocking(self._prompts, request.input, request.truncate_prompt_tokens)
        params = PoolingParams(normalize=bool(request.normalize), dimensions=request.dimensions,
                               truncate_prompt_tokens=request.truncate_prompt_tokens, task="encode")
        outs = await self.embed(prompts, params, "pool")
        data = [PoolingData(index=i, data=_encode_vector(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outs)]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return PoolingResponse(id=f"pool-{uuid.uuid4().hex}", created=int(time.time()), model=model, data=data,
                               usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def classify(self, request: ClassificationRequest) -> ClassificationResponse:
        """Class probabilities per input, labelled by the model's id2label."""
        self.check_pooling_runner()
        if not getattr(self.model_config, "classify", False):
            raise OpenAIError("classify needs a sequence-classification model; this server's model is not one",
                              param="model")
        model = self.model_name(request.model)
        prompts = await run_blocking(self._prompts, request.input, request.truncate_prompt_tokens)
        params = PoolingParams(normalize=False, truncate_prompt_tokens=request.truncate_prompt_tokens, task="classify")
        outs = await self.embed(prompts, params, "classify")
        labels = getattr(self.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=labels.get(best), probs=probs, num_classes=len(probs)))
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return ClassificationResponse(id=f"classify-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                      data=data, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def embed(self, prompts: list[list[int]] | list[dict], params: PoolingParams,
                    prefix: str) -> list[PoolingRequestOutput]:
        """Every prompt's pooled output, all submitted at once (the scheduler batches them)."""
        base_id = f"{prefix}-{uuid.uuid4().hex}"
        return list(await asyncio.gather(*[self._encode(p, params, f"{base_id}-{i}") for i, p in enumerate(prompts)]))

    def _prompts(self, inputs, truncate_prompt_tokens: int | None, param: str = "input") -> list[list[int]]:
        """Token ids per input; an input over max_model_len is a 400 unless truncated."""
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise OpenAIError(f"{param} must not be empty", param=param)
        prompts = []
        for item in inputs:
            ids = self.encode(item, param=param) if isinstance(item, str) else list(item)
            if not ids:
                raise OpenAIError(f"an item of {param} is empty (no tokens)", param=param)
            self.check_token_ids(ids, param)
            if truncate_prompt_tokens is not None:
                ids = ids[-truncate_prompt_tokens:]
            if len(ids) > self.max_model_len:
                raise OpenAIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, an item of "
                    f"{param} is {len(ids)} tokens long. Shorten it, or set truncate_prompt_tokens.", param=param)
            prompts.append(ids)
        return prompts

    async def _encode(self, prompt: list[int] | dict, params: PoolingParams, request_id: str) -> PoolingRequestOutput:
        try:
            async for out in self.engine.encode(prompt, params, request_id):
                if out.finished:
                    if self.metrics is not None:
                        self.metrics.count_pooled(len(out.prompt_token_ids))
                    return out
        except ValueError as e:
            raise OpenAIError(str(e), param="dimensions" if "dimensions" in str(e) else "input") from None
        raise OpenAIError(f"request {request_id} ended without an embedding", 500)


def _encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
