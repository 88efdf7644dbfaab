"""EngineArgs: what `LLM(...)`, the CLI (`generate`, `bench`, `serve`) and the engine-core
process take, with vLLM's names. Every entry point builds one and calls
`create_engine_config()`, so all agree on defaults and on what is an error. Resolving the model
to files (and converting a GGUF) happens here, above config.py, which only describes and checks.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from pagedllm.config import (
    POOLING_ARCHITECTURES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    build_lora_config,
    build_model_config,
    build_parallel_config,
    build_pooler_config,
    check_async_scheduling,
    check_lora_support,
    check_pipeline_parallel,
    check_quantization,
    check_tensor_parallel,
    draft_model_config,
    is_classifier,
    parse_speculative_config,
    resolve_device,
)
from pagedllm.model_executor.models.registry import ModelRegistry
from pagedllm.transformers_utils.default_model import DEFAULT_POOLING_MODEL
from pagedllm.transformers_utils.model_path import (
    is_hub_id,
    resolve_hub_model,
    resolve_model_path,
    resolves_on_disk,
)

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")


@dataclass
class EngineArgs:
    """User-facing engine arguments; field names match vLLM's flags."""

    model: str | None = None
    tokenizer: str | None = None
    # A Hub id's revision (branch, tag or commit), where Hub downloads go (default: HF_HUB_CACHE), the
    # tokenizer's revision, and a directory or Hub id to read config.json from instead of the model's
    revision: str | None = None
    download_dir: str | None = None
    tokenizer_revision: str | None = None
    hf_config_path: str | None = None
    # auto (safetensors, else .bin; .gguf by its suffix), safetensors, pt, gguf, or dummy: random
    # weights of the right shapes, for profiling without the checkpoint's read
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, without CUDA graphs
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # Most samples (n, and best_of) per request; more is a ValueError (HTTP 400). Samples beyond
    # max_num_seqs still run, in waves. 128 is OpenAI's limit on n.
    max_n: int = 128
    # Most sequences (prompts x n, or best_of) one server request may start: a prompt list
    # fans out too, so max_n alone does not bound it.
    max_sequences_per_request: int = 1024
    enable_chunked_prefill: bool = True
    # Most tokens one request computes in a step (0: the budget's limit only): a long prompt's
    # chunks stay this small, so running decodes are not held up behind it
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    # Schedule the next step while the current one runs (vLLM's --async-scheduling)
    async_scheduling: bool = False
    trust_remote_code: bool = False
    quantization: str | None = None
    # {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...} or its JSON
    speculative_config: dict | str | None = None
    # "deepseek_r1" or "qwen3": structured outputs start after the reasoning (and the server
    # splits reasoning_content from content)
    reasoning_parser: str | None = None
    # "auto": "pooling" for encoder-only architectures (BERT), else "generate"
    runner: str = "auto"
    # What a pooling model returns: "embed" (the pooled vector; a classifier's head is skipped),
    # "classify" (a sequence classifier's probabilities), "auto" (by the architecture). Implies
    # the pooling runner.
    convert: str = "auto"
    # The pooling runner's {"pooling_type": "MEAN" | "CLS" | "LAST", "normalize": bool}, or its JSON
    pooler_config: dict | str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "uni", "mp" or "ray"; default: uni for one rank, else mp
    # Multi-LoRA: requests may name PEFT adapters (LoRARequest), up to max_loras distinct ones per step
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # loaded adapters kept (LRU); default: max_loras

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def resolves_on_disk(self) -> bool:
        """Whether create_engine_config only reads files already there (no GGUF conversion, no
        download, no speculative decoding config, no remote code to copy into transformers'
        module cache), so two processes may build the same config at once."""
        model = DEFAULT_POOLING_MODEL if self.model is None and self.runner == "pooling" else self.model
        return (self.speculative_config is None and not self.trust_remote_code and resolves_on_disk(model)
                and not any(p is not None and is_hub_id(p) for p in (self.hf_config_path, self.tokenizer)))

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model (and a draft model) to their files, converting a GGUF once into its
        cache, then build and check the config; every error is a ValueError."""
        # Async scheduling overlaps the engine core with worker processes: one rank goes to one.
        backend = self.distributed_executor_backend or ("mp" if self.async_scheduling else None)
        parallel_config = build_parallel_config(self.tensor_parallel_size, self.pipeline_parallel_size,
                                                self.data_parallel_size, backend)
        device = resolve_device(self.device)
        check_quantization(self.quantization, device)
        if device.type == "cuda":
            check_cuda_layout(parallel_config)
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {self.runner!r}")
        model = DEFAULT_POOLING_MODEL if self.model is None and self.runner == "pooling" else self.model
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.load_format == "gguf" and model is not None and not str(model).endswith(".gguf"):
            raise ValueError(f"load_format gguf needs a .gguf file, got {model!r}")
        model_path = resolve_model_path(model, self.revision, self.download_dir, self.load_format)
        hf_config_path = self.hf_config_path
        if hf_config_path is not None and is_hub_id(hf_config_path):
            hf_config_path = resolve_hub_model(hf_config_path, None, self.download_dir, what="config")
        tokenizer = self.tokenizer
        if tokenizer is not None and is_hub_id(tokenizer):
            tokenizer = resolve_hub_model(tokenizer, self.tokenizer_revision, self.download_dir, what="tokenizer")
        model_config = build_model_config(
            model, model_path, tokenizer, self.dtype, device, self.max_model_len or _st_max_len(model_path),
            self.seed, self.trust_remote_code, self.quantization, hf_config_path,
        )
        model_config.load_format = self.load_format
        model_config.enforce_eager = self.enforce_eager
        if not ModelRegistry.is_supported(model_config.architecture):
            raise ValueError(f"model architecture {model_config.architecture!r} of {model!r} is not supported; "
                             f"supported: {', '.join(ModelRegistry.get_supported_archs())} (or register your own "
                             "with pagedllm.ModelRegistry.register_model)")
        if self.convert not in ("auto", "embed", "classify"):
            raise ValueError(f"convert must be auto, embed or classify, got {self.convert!r}")
        classifier = is_classifier(model_config.architecture)
        if self.convert == "classify" and not classifier:
            raise ValueError("--convert classify needs a sequence-classification checkpoint "
                             f"(*ForSequenceClassification, with its head); {model_config.architecture} has none")
        runner = "pooling" if self.convert != "auto" and self.runner == "auto" else self.runner
        is_encoder = model_config.architecture in POOLING_ARCHITECTURES or classifier
        model_config.runner = ("pooling" if is_encoder else "generate") if runner == "auto" else runner
        model_config.classify = classifier and self.convert != "embed"
        pooling = model_config.runner == "pooling"
        if is_encoder and not pooling:
            raise ValueError(f"{model_config.architecture} embeds or classifies, it cannot generate text; "
                             "start it with --runner pooling")
        if pooling:
            model_config.pooler_config = build_pooler_config(model_path, model_config.architecture,
                                                             self.pooler_config)
        elif self.pooler_config is not None:
            raise ValueError("pooler_config needs --runner pooling")
        check_tensor_parallel(model_config, parallel_config.tensor_parallel_size)
        max_model_len = model_config.max_model_len
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_sequences_per_request < 1:
            raise ValueError(f"max_sequences_per_request must be >= 1, got {self.max_sequences_per_request}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        max_batched = self.max_num_batched_tokens
        # A pooled prompt is computed in one step (an encoder attends to all of it at once), and
        # every token's hidden state is needed (no prefix-cache hits).
        chunked_prefill = self.enable_chunked_prefill and not pooling
        if max_batched is None:
            max_batched = 8192 if chunked_prefill else max(8192, max_model_len)
        if max_batched < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_batched}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold chunks long prompts: it needs chunked prefill enabled")
        if not chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled; a long prompt could never run"
            )

        speculative_config = parse_speculative_config(self.speculative_config)
        if pooling and speculative_config is not None:
            raise ValueError("speculative decoding needs --runner generate: a pooling request generates no tokens")
        if speculative_config is not None and speculative_config.method == "draft_model":
            speculative_config.draft_model_config = draft_model_config(
                speculative_config, resolve_model_path(speculative_config.model), model_config, device,
                self.quantization,
            )
            check_tensor_parallel(speculative_config.draft_model_config, parallel_config.tensor_parallel_size)
        check_pipeline_parallel(model_config, parallel_config.pipeline_parallel_size,
                                speculative_config is not None and speculative_config.method == "draft_model")
        if self.async_scheduling:
            check_async_scheduling(parallel_config, speculative_config is not None)
        lora_config = None
        if self.enable_lora:
            lora_config = build_lora_config(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
            check_lora_support(model_config, parallel_config, speculative_config is not None)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching and not pooling,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold if chunked_prefill else 0,
                policy=self.scheduling_policy,
                max_n=self.max_n,
                max_sequences_per_request=self.max_sequences_per_request,
                async_scheduling=self.async_scheduling,
            ),
            device_config=DeviceConfig(device=device),
            speculative_config=speculative_config,
            structured_outputs_config=StructuredOutputsConfig(reasoning_parser=self.reasoning_parser or None),
            parallel_config=parallel_config,
            lora_config=lora_config,
        )



def check_cuda_layout(parallel: ParallelConfig) -> None:
    """On CUDA each rank of a core takes a GPU of its own (rank r: cuda:r): refuse a layout that
    this machine's GPUs cannot hold, or several data-parallel cores, which would share GPU 0."""
    if parallel.data_parallel_size > 1:
        raise ValueError("data_parallel_size > 1 is not supported on CUDA: the engine cores would share one GPU; "
                         "run one server per GPU, or use tensor/pipeline parallelism")
    import torch

    have = torch.cuda.device_count()
    if parallel.world_size > have:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {parallel.world_size} ranks need as many "
                         f"GPUs, one per rank; this machine has {have}")


def _st_max_len(model_path: str) -> int | None:
    """A sentence-transformers model's max_seq_length (sentence_bert_config.json), its default length."""
    path = os.path.join(model_path, "sentence_bert_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("max_seq_length")
