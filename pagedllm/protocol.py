"""The messages that cross the front-end / engine-core process boundary, in one module.

They sit on the ground floor (above `sampling_params` only), so the scheduler, the engine core
and its client all import them downward, as vLLM keeps its `EngineCore*` types in
`vllm/v1/engine/__init__.py`. The next process boundary (a distributed executor) puts its
messages here too. Everything is plain data that msgspec encodes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of a front → core message; bytes, so it goes to ZMQ as it is."""

    ADD = b"ADD"  # payload: EngineCoreRequest
    ABORT = b"ABORT"  # payload: list of request ids
    UTILITY = b"UTILITY"  # payload: (call id, method, args)
    SHUTDOWN = b"SHUTDOWN"


class EngineCoreOutputType(bytes, enum.Enum):
    """First frame of a core → front message."""

    READY = b"READY"  # once, after start-up: the core's stats
    FAILED = b"FAILED"  # once, instead of READY: the error
    OUTPUTS = b"OUTPUTS"  # EngineCoreOutputs, after every step that produced something
    UTILITY_RESULT = b"UTILITY_RESULT"  # (call id, ok, result or error)


class TensorData(msgspec.Struct, array_like=True, gc=False):
    """An array as plain data (dtype name, shape, raw bytes): a processed image's pixels cross the
    process boundaries (front → core → workers) as this, never pickled."""

    dtype: str  # numpy's name for it: "float32", "int64", ...
    shape: list[int]
    data: bytes


class MultiModalFeature(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One image of a prompt, processed: where its placeholder tokens are, and its encoder's inputs.

    `identifier` is the hash of the image's content (and processor settings): it keys the encoder
    cache, the processed-input cache shared by the front end and the core, and the prefix-cache
    hashes of the blocks its placeholders fall in. `data` is None when the front end knows the core
    holds this identifier's inputs already (a repeated image is sent once)."""

    modality: str  # "image"
    identifier: str
    offset: int  # its first placeholder token in the prompt
    length: int  # placeholder tokens: one per embedding the encoder makes
    data: dict[str, TensorData] | None = None


@dataclass(slots=True)
class EngineCoreRequest:
    """What the front end hands to the engine core: already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    group_id: str | None = None
    # A pooling request: its prompt is pooled into one vector, and it generates nothing.
    pooling_params: PoolingParams | None = None
    # A text pair for a cross-encoder: which tokens belong to the second text (BERT's segments).
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # Images of a multimodal prompt, in prompt order (their placeholders do not overlap).
    mm_features: list[MultiModalFeature] | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request after one step; plain data so it can cross a process boundary."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # One (token ids, logprobs, rank) per new token: the sampled token first, then the top-k.
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # Sent with the first token: one entry per prompt token after the first.
    prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # A pooling request's vector (with its finish).
    pooling_output: list[float] | None = None
    # Sent with the first token: when the core first scheduled the request (wall clock, time.time()).
    scheduled_time: float | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
