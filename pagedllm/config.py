"""The engine's configuration as dataclasses (model, cache, scheduler, device, speculative
decoding, structured outputs) and the checks that build them.

This module describes and validates: it reads a model's config.json but never converts files.
`EngineArgs.create_engine_config()` (engine/arg_utils.py) resolves names and paths first
(transformers_utils: the default model, a GGUF converted once into its cache), then builds
these. It imports nothing from the model code above it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm import cpu_isa
from pagedllm.transformers_utils.default_model import DEFAULT_MODEL

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


@dataclass(slots=True)
class ModelConfig:
    model: str  # the name or path the user gave
    model_path: str  # resolved HF-style directory
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    seed: int
    tokenizer: str
    trust_remote_code: bool = False
    quantization: str | None = None  # weight-only "int8" / "int4" (CPU), applied after loading; None: off
    runner: str = "generate"  # or "pooling": each request's prompt is pooled into one vector
    pooler_config: PoolerConfig | None = None  # the pooling runner's
    classify: bool = False  # a pooling classifier returns its head's probabilities, not the pooled state
    load_format: str = "auto"  # auto, safetensors, pt, gguf (converted by then) or dummy (random weights)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    # A vision-language model: most items per prompt by modality, and the front end's cache of
    # processed images (bytes; mirrored in the engine core).
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    mm_processor_cache_bytes: int = 4 << 30
    # Which image URLs chat messages may name (entrypoints/media.py has the rules).
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    # An image's tokens attend to each other both ways during the prompt (Gemma 3), set from
    # the model class's `is_mm_prefix_lm`.
    is_mm_prefix_lm: bool = False

    @property
    def is_multimodal(self) -> bool:
        """A checkpoint with a vision tower (its config has a vision_config)."""
        return getattr(self.hf_config, "vision_config", None) is not None

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    @property
    def text_config(self) -> Any:
        get = getattr(self.hf_config, "get_text_config", None)
        return get() if get else self.hf_config


POOLING_TYPES = ("MEAN", "CLS", "LAST")
# Architectures that only pool (encoders): `--runner auto` picks "pooling" for them.
POOLING_ARCHITECTURES = {"BertModel", "BertForSequenceClassification"}


def is_classifier(architecture: str) -> bool:
    """A sequence classifier: its pooled state goes through a head to one logit per label."""
    return architecture.endswith("ForSequenceClassification")


@dataclass(slots=True)
class PoolerConfig:
    """How hidden states become one vector (vLLM's --pooler-config): MEAN over the prompt's
    tokens, its first (CLS) or last token; then L2-normalized unless `normalize` is False."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        self.pooling_type = str(self.pooling_type).upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")


def build_pooler_config(model_path: str, architecture: str, override: dict | str | None) -> PoolerConfig:
    """A sentence-transformers model says its pooling in modules.json (Pooling, Normalize); an
    encoder defaults to CLS, a decoder to its last token; `override` (a dict or its JSON) wins."""
    config = PoolerConfig("CLS" if architecture in POOLING_ARCHITECTURES else "LAST", True)
    modules_path = os.path.join(model_path, "modules.json")
    if os.path.isfile(modules_path):
        with open(modules_path) as f:
            modules = json.load(f)
        config.normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        for m in modules:
            if m.get("type", "").endswith(".Pooling"):
                with open(os.path.join(model_path, m.get("path", ""), "config.json")) as f:
                    pooling = json.load(f)
                for mode, name in (("pooling_mode_mean_tokens", "MEAN"), ("pooling_mode_cls_token", "CLS"),
                                   ("pooling_mode_lasttoken", "LAST")):
                    if pooling.get(mode):
                        config.pooling_type = name
    override = json_dict(override, "pooler_config")
    if override:
        unknown = set(override) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config: unknown keys {sorted(unknown)}")
        config = PoolerConfig(override.get("pooling_type", config.pooling_type), override.get("normalize",
                                                                                           config.normalize))
    return config


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None = fraction of free memory
    gpu_memory_utilization: float = 0.9  # fraction of free memory for weights + KV
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    num_blocks: int = 0  # filled in once the KV cache is sized
    # auto: the model's dtype; int8 / fp8 (= fp8_e4m3) / fp8_e5m2: a byte an element with a scale
    # per 32 elements (model_executor/layers/kv_quant.py)
    cache_dtype: str = "auto"


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0
    enable_chunked_prefill: bool = True
    # A request computes at most this many tokens a step (0: no cap beyond the budget), so a
    # long prompt's chunks stay small beside running decodes (vLLM's name)
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"  # or "priority"
    max_n: int = 128  # most samples (n, best_of) one request may ask for
    # Most sequences (prompts x best_of) one server request may fan out to; more is HTTP 400
    max_sequences_per_request: int = 1024
    # Schedule step N + 1 while step N runs: each running request's token from step N is a
    # placeholder that the workers fill in from their own sample (vLLM's async scheduling)
    async_scheduling: bool = False
    # A vision-language model: image embeddings the encoder makes per step at most, and how many
    # the encoder cache holds (0: a text model; the engine sets both from the token budget).
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0
    # Never split an image's placeholders across steps (vLLM's name): set for models whose image
    # tokens attend to each other both ways (ModelConfig.is_mm_prefix_lm).
    disable_chunked_mm_input: bool = False


def json_dict(value: Any, name: str) -> dict | None:
    """A dict-valued option as given: a dict, or its JSON text (as on the command line); None stays None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict), got {type(value).__name__}")
    return value


def parse_limit_mm_per_prompt(value: dict | str | None) -> dict[str, int]:
    """--limit-mm-per-prompt '{"image": 2}' (vLLM's): most items of each modality in one prompt."""
    if value is None or value == "":
        return {"image": 1}
    value = json_dict(value, "limit_mm_per_prompt")
    out = {}
    for k, v in value.items():
        if k != "image":
            raise ValueError(f"limit_mm_per_prompt: modality {k!r} is not supported; only 'image' is")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"limit_mm_per_prompt[{k!r}] must be an integer >= 0, got {v!r}")
        out[k] = v
    return {"image": 1, **out}


@dataclass(slots=True)
class DeviceConfig:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(slots=True, frozen=True)
class MedusaConfig:
    """Medusa heads' shape (`spec_decode/medusa.py` reads it from their files)."""

    num_heads: int
    num_layers: int  # residual blocks per head
    hidden_size: int
    vocab_size: int


@dataclass(slots=True)
class SpeculativeConfig:
    """Draft tokens proposed each step and verified by the target in one forward pass."""

    method: str  # "ngram", "draft_model", "medusa", "eagle", "eagle3" or "mtp"
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram: shortest suffix n-gram to look up
    prompt_lookup_max: int = 0  # ngram: longest
    model: str | None = None  # draft_model / medusa / eagle(3): the draft model's or head's name or path, as given
    draft_model_config: ModelConfig | None = None  # draft_model only
    heads_path: str | None = None  # medusa / eagle(3): the head's resolved directory; mtp: the target's
    medusa_config: MedusaConfig | None = None  # medusa only
    # eagle(3): the head's transformers config (its decoder layers' shape); mtp: the target's text config
    eagle_config: Any = None
    # No drafts are proposed after a step that ran at least this many requests (None: always):
    # on a CPU, k + 1 rows per request cost nearly k + 1 times one once the batch is compute-bound.
    disable_by_batch_size: int | None = None
    # eagle / eagle3 / mtp: a chain of drafts ends before the draft whose head-estimated chance
    # (the product of the head's probabilities of it and the drafts before it) falls under this;
    # 0: always k drafts. A request may then get fewer drafts, or none, in a step.
    draft_confidence_threshold: float = 0.0
    # eagle3: the tokens of a request's context outside the head's draft vocabulary are drafts
    # too, scored on the target's embedding rows (spec_decode/context_tokens.py); None: as the
    # head's config says (`eagle_config.draft_context_tokens`), else off.
    draft_context_tokens: bool | None = None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past its scheduled tokens: a draft model or an EAGLE head
        writes its own K/V for the tokens it proposes, in the request's blocks."""
        return self.num_speculative_tokens if self.method in KV_DRAFTERS else 0


# the drafters with layers of their own in the paged KV cache
KV_DRAFTERS = ("draft_model", "eagle", "eagle3", "mtp")
EAGLE_METHODS = ("eagle", "eagle3", "mtp")  # the drafters on the target's hidden states (spec_decode/eagle.py)
SPECULATIVE_METHODS = ("ngram", "draft_model", "medusa", *EAGLE_METHODS)


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(slots=True)
class ParallelConfig:
    """How the model is spread over ranks (vLLM's names). One rank runs in the engine-core process
    ("uni", the default) or in a worker process ("mp"); tensor x pipeline parallel ranks run one
    worker process each ("mp") or one Ray actor each ("ray"). Each of the data_parallel_size
    engine cores has its own ranks."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    # torch.distributed's rendezvous (tcp://127.0.0.1:PORT), set by the executor that starts the
    # ranks, before it starts them; None with one rank.
    distributed_init_method: str | None = None

    @property
    def world_size(self) -> int:
        """Ranks of one engine core (data-parallel replicas are separate engine cores)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def build_parallel_config(tp: int, pp: int, dp: int, backend: str | None) -> ParallelConfig:
    for name, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp), ("data_parallel_size", dp)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
    if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                         f"got {backend!r}")
    config = ParallelConfig(tp, pp, dp, backend or ("uni" if tp * pp == 1 else "mp"))
    if config.world_size > 1 and config.distributed_executor_backend == "uni":
        raise ValueError(
            f"distributed_executor_backend='uni' runs one rank in the engine-core process; "
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs 'mp' or 'ray' (one worker per rank)")
    return config


def check_pipeline_parallel(model_config: ModelConfig, pp: int, draft_model: bool) -> None:
    """That every stage gets a layer, and no draft model or EAGLE head (`draft_model`: it would
    need stages of its own)."""
    if pp == 1:
        return
    if model_config.architecture in POOLING_ARCHITECTURES:
        raise ValueError(f"{model_config.architecture} runs whole on each rank: use tensor_parallel_size, not "
                         "pipeline_parallel_size")
    layers = model_config.text_config.num_hidden_layers
    if layers < pp:
        raise ValueError(f"pipeline_parallel_size={pp} is more than the {layers} layers of {model_config.model}")
    if draft_model:
        raise ValueError("a draft model or a head on the target's hidden states (EAGLE, EAGLE-3, MTP) needs "
                         "pipeline_parallel_size=1; ngram works")


def check_tensor_parallel(model_config: ModelConfig, tp: int) -> None:
    """That the model's heads and MLP split evenly over `tp` ranks: query heads and the MLP's (and
    experts') intermediate size divide by tp; kv heads divide by tp, or tp by them (each kv head is then
    replicated on tp / num_kv_heads ranks). The vocabulary is padded, so any size splits."""
    if tp == 1:
        return
    text = model_config.text_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    what = f"tensor_parallel_size={tp} does not fit {model_config.model}"
    if heads % tp:
        raise ValueError(f"{what}: num_attention_heads={heads} is not divisible by {tp}")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"{what}: num_key_value_heads={kv_heads} and {tp} do not divide one another")
    for key in ("intermediate_size", "moe_intermediate_size"):  # the MLP's, the experts'
        inter = getattr(text, key, None)
        if inter is not None and inter % tp:
            raise ValueError(f"{what}: {key}={inter} is not divisible by {tp}")


@dataclass(slots=True)
class StructuredOutputsConfig:
    # With a reasoning parser (its think tags: structured_output/reasoner.py), a request's
    # grammar applies only after the reasoning ends.
    reasoning_parser: str | None = None


@dataclass(slots=True)
class LoRAConfig:
    """Multi-LoRA: adapters live in `max_loras` slots of stacked weights (one step uses at most
    that many distinct adapters); `max_cpu_loras` loaded adapters are kept, least recently used
    evicted first."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


MAX_LORA_RANK_LIMIT = 256


def build_lora_config(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> LoRAConfig:
    if max_loras < 1:
        raise ValueError(f"max_loras must be >= 1, got {max_loras}")
    if not 1 <= max_lora_rank <= MAX_LORA_RANK_LIMIT:
        raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK_LIMIT}], got {max_lora_rank}")
    cpu = max_loras if max_cpu_loras is None else max_cpu_loras
    if cpu < max_loras:
        raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({max_loras})")
    return LoRAConfig(max_loras, max_lora_rank, cpu)


LORA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "Gemma3ForCausalLM")


def check_lora_support(model_config: ModelConfig, parallel: ParallelConfig, speculative: bool) -> None:
    """LoRA runs on the decoder LMs, on one rank, without speculative decoding: clear errors otherwise."""
    if model_config.runner != "generate":
        raise ValueError("--enable-lora needs --runner generate")
    if model_config.architecture not in LORA_ARCHITECTURES:
        raise ValueError(f"LoRA is not supported for {model_config.architecture}; "
                         f"supported: {', '.join(LORA_ARCHITECTURES)}")
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ValueError("--enable-lora runs on one rank: use -dp for more engines, not -tp or -pp")
    if speculative:
        raise ValueError("--enable-lora cannot be combined with --speculative-config")


def check_async_scheduling(parallel: ParallelConfig, speculative: bool) -> None:
    """A step scheduled before the last one's tokens are known takes one new token per request,
    in one pipeline stage: drafts to verify, or stages that never sample, would need more. The
    step runs beside the engine core only in worker processes: in-process, the engine would
    only hand out each step's tokens one forward pass later."""
    if parallel.distributed_executor_backend == "uni":
        raise ValueError("--async-scheduling runs the model in worker processes: use --distributed-executor-backend "
                         "mp (the default with it) or ray, not uni")
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("--async-scheduling cannot be combined with pipeline parallel (-pp > 1)")
    if speculative:
        raise ValueError("--async-scheduling cannot be combined with --speculative-config")


@dataclass(slots=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    speculative_config: SpeculativeConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig | None = None  # None: LoRA off


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return torch.device(device)


def _resolve_dtype(dtype: str | torch.dtype, hf_config: Any, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # On CPU, bf16 halves the bytes every decode step streams and runs GEMMs on the
    # bf16 units; without native bf16 it is emulated and slower than float32.
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    return cpu_isa.has_native_bf16()


# int8 / int4: the engine's own weight-only copies, made at load; gguf: a GGUF file's own blocks;
# gptq / awq / compressed-tensors / fp8: a pre-quantized checkpoint's weights, repacked into blocks
# as they load (transformers_utils/quantized_checkpoint.py); fp8 on a float checkpoint: its
# linears quantized to float8 e4m3 at load (loader/fp8.py), then blocked the same way. All but
# int8 / int4 run on the GGUF kernels.
CHECKPOINT_QUANTIZATION = ("gptq", "awq", "compressed-tensors", "fp8")
ONLINE_QUANTIZATION = ("int8", "int4", "fp8")
QUANTIZATION_METHODS = ("int8", "int4", "fp8", "gguf", "gptq", "awq", "compressed-tensors")
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, "none")
# What a GGUF checkpoint with quantized tensors runs as on CPU when --quantization is not given.
GGUF_CPU_QUANTIZATION = "gguf"


# --kv-cache-dtype: auto is the model's dtype; the rest store a byte an element (kv_quant.py)
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(cache_dtype: str) -> None:
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {cache_dtype!r}")


def check_quantization(method: str | None, device: torch.device) -> None:
    if method is None or method == "none":
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None, 'none' or one of {', '.join(QUANTIZATION_METHODS)}; "
                         f"got {method!r}")
    if device.type != "cpu":
        # The kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) are CPU ones.
        raise ValueError(f"quantization={method!r} runs on CPU only, not on device {str(device)!r}")


def resolve_quantization(
    method: str | None, model_path: str, device: torch.device, dtype: str | torch.dtype, hf_config: Any = None
) -> str | None:
    """The method a model runs with: as given; "none" for none; and when not given, a GGUF
    checkpoint with quantized tensors runs quantized on CPU (as vLLM runs GGUF files with its
    GGUF kernels) instead of dequantized, unless float32 was asked for by name (full
    precision, the mode the exactness tests compare in). `dtype` is the one asked for: "auto"
    picking float32 on a CPU without native bf16 still runs quantized. A pre-quantized
    checkpoint (GPTQ, AWQ, compressed-tensors) runs as what its config says, whatever the
    dtype; asking for another method is an error."""
    from pagedllm.transformers_utils.gguf_loader import gguf_is_quantized
    from pagedllm.transformers_utils.quant_config import read_quant_format

    fmt = read_quant_format(hf_config) if hf_config is not None else None
    if fmt is not None:
        if method not in (None, fmt.method):
            raise ValueError(f"{model_path} is a {fmt.method} checkpoint: it runs as quantization={fmt.method!r}, "
                             f"not {method!r}")
        check_quantization(fmt.method, device)
        return fmt.method
    if method in CHECKPOINT_QUANTIZATION and method not in ONLINE_QUANTIZATION:
        raise ValueError(f"quantization={method!r} needs a {method} checkpoint; {model_path} has no "
                         "quantization_config of that method")
    if method == "none":
        return None
    if method == "gguf" and not os.path.isfile(os.path.join(model_path, "gguf_source.json")):
        raise ValueError(f"quantization='gguf' runs a GGUF file's own blocks; {model_path} is not a GGUF file")
    full_precision = dtype in (torch.float32, "float32", "float")
    if method is None and device.type == "cpu" and not full_precision and gguf_is_quantized(model_path):
        return GGUF_CPU_QUANTIZATION
    return method


def build_model_config(
    model: str | None,
    model_path: str,
    tokenizer: str | None,
    dtype: str | torch.dtype,
    device: torch.device,
    max_model_len: int | None,
    seed: int,
    trust_remote_code: bool,
    quantization: str | None = None,
    hf_config_path: str | None = None,
) -> ModelConfig:
    """The config of a model the user named `model` whose HF-style files are at `model_path`
    (transformers_utils.model_path.resolve_model_path made them); shared by the target and a
    draft model."""
    from transformers import AutoConfig

    from pagedllm.transformers_utils.mimo_config import register_mimo_config

    register_mimo_config()
    hf_config = AutoConfig.from_pretrained(hf_config_path or model_path, trust_remote_code=trust_remote_code)
    text_config = hf_config.get_text_config()
    derived_max = getattr(text_config, "max_position_embeddings", None) or 2048
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    if max_model_len and max_model_len > derived_max:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the max_position_embeddings={derived_max} of {model_path}"
        )
    resolved_dtype = _resolve_dtype(dtype, text_config, device)
    return ModelConfig(
        model=model or DEFAULT_MODEL,
        model_path=model_path,
        hf_config=hf_config,
        dtype=resolved_dtype,
        max_model_len=max_model_len or derived_max,
        seed=seed,
        tokenizer=tokenizer or model_path,
        trust_remote_code=trust_remote_code,
        quantization=resolve_quantization(quantization, model_path, device, dtype, hf_config),
    )


_SPEC_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "disable_by_batch_size", "draft_confidence_threshold", "draft_context_tokens"}


def parse_speculative_config(spec: dict | str | None) -> SpeculativeConfig | None:
    """From the user's dict (or its JSON, as on the command line) to a checked config; a draft
    model's own config is added once its files are resolved (draft_model_config)."""
    if spec is None or spec == {}:
        return None
    spec = json_dict(spec, "speculative_config")
    unknown = set(spec) - _SPEC_KEYS
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; known: {sorted(_SPEC_KEYS)}")
    method = spec.get("method") or ("draft_model" if spec.get("model") else None)
    if method in ("[ngram]", "ngram") or spec.get("model") == "[ngram]":
        method = "ngram"
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config.method must be one of {', '.join(map(repr, SPECULATIVE_METHODS))}, "
                         f"got {method!r}")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
    config = SpeculativeConfig(method=method, num_speculative_tokens=k)
    off = spec.get("disable_by_batch_size")
    if off is not None and (not isinstance(off, int) or isinstance(off, bool) or off < 2):
        raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 2, got {off!r}")
    config.disable_by_batch_size = off
    threshold = spec.get("draft_confidence_threshold")
    if threshold is not None:
        if method not in EAGLE_METHODS:
            raise ValueError("speculative_config.draft_confidence_threshold is for the methods that draft from the "
                             f"target's hidden states ({', '.join(EAGLE_METHODS)}), not {method!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
            raise ValueError(f"speculative_config.draft_confidence_threshold must be a number in [0, 1), "
                             f"got {threshold!r}")
        config.draft_confidence_threshold = float(threshold)
    context = spec.get("draft_context_tokens")
    if context is not None:
        if method != "eagle3":
            raise ValueError(f"speculative_config.draft_context_tokens is for EAGLE-3 heads (a draft vocabulary "
                             f"smaller than the target's), not {method!r}")
        if not isinstance(context, bool):
            raise ValueError(f"speculative_config.draft_context_tokens must be true or false, got {context!r}")
        config.draft_context_tokens = context
    if method == "ngram":
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or lo < 1 or hi < lo:
            raise ValueError(
                f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )
        config.prompt_lookup_min, config.prompt_lookup_max = lo, hi
        return config
    if method == "mtp":  # the target's own layers: `model` may name the target, or be left out
        config.model = spec.get("model")
        return config
    if not spec.get("model"):
        what = {"draft_model": "the draft model", "medusa": "the Medusa heads", "eagle": "the EAGLE head",
                "eagle3": "the EAGLE-3 head"}[method]
        raise ValueError(f"speculative_config: method {method!r} needs 'model' (a path to {what})")
    config.model = spec["model"]
    return config


def draft_model_config(
    config: SpeculativeConfig, draft_path: str, target: ModelConfig, device: torch.device, quantization: str | None
) -> ModelConfig:
    """The draft model's config, from its resolved files: the target's dtype, length and seed, and
    the same vocabulary (speculation compares token ids)."""
    draft = build_model_config(config.model, draft_path, None, target.dtype, device, target.max_model_len,
                               target.seed, target.trust_remote_code, quantization)
    if draft.text_config.vocab_size != target.text_config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.text_config.vocab_size}) differs from the target's "
            f"({target.text_config.vocab_size}); speculation needs the same tokenizer"
        )
    return draft
