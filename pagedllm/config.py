"""Engine arguments as dataclasses, validated in one place.

`LLM(...)`, the CLI (`generate`, `bench`, later `serve`) and the engine all build
an `EngineArgs` and call `create_engine_config()`, so every entry point agrees on
defaults and on what is an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.model_executor.loader.default_model import DEFAULT_MODEL
from pagedllm.model_executor.loader.model_path import resolve_model_path

if TYPE_CHECKING:  # spec_decode.config builds on this module, so only the type is imported here
    from pagedllm.spec_decode.config import SpeculativeConfig

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

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    @property
    def text_config(self) -> Any:
        get = getattr(self.hf_config, "get_text_config", None)
        return get() if get else self.hf_config


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None = fraction of free memory
    gpu_memory_utilization: float = 0.9  # fraction of free memory for weights + KV
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    num_blocks: int = 0  # filled in once the KV cache is sized


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority"


@dataclass(slots=True)
class DeviceConfig:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(slots=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    speculative_config: SpeculativeConfig | None = None


def _resolve_device(device: str) -> torch.device:
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
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


QUANTIZATION_METHODS = ("int8", "int4")
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, "none")
# What a GGUF checkpoint with quantized tensors runs as on CPU when --quantization is not given.
GGUF_CPU_QUANTIZATION = "int4"


def _check_quantization(method: str | None, device: torch.device) -> None:
    if method is None or method == "none":
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None, 'none', 'int8' or 'int4'; got {method!r}")
    if device.type != "cpu":
        # The kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) are CPU ones.
        raise ValueError(f"quantization={method!r} runs on CPU only, not on device {str(device)!r}")


def resolve_quantization(
    method: str | None, model_path: str, device: torch.device, dtype: torch.dtype
) -> str | None:
    """The method a model runs with: as given; "none" for none; and when not given, a GGUF
    checkpoint with quantized tensors runs quantized on CPU (as vLLM runs GGUF files with its
    GGUF kernels) instead of dequantized, unless float32 was asked for (full precision, the
    mode the exactness tests compare in)."""
    from pagedllm.model_executor.loader.gguf_loader import gguf_is_quantized

    if method == "none":
        return None
    if method is None and device.type == "cpu" and dtype != torch.float32 and gguf_is_quantized(model_path):
        return GGUF_CPU_QUANTIZATION
    return method


def build_model_config(
    model: str | None,
    tokenizer: str | None,
    dtype: str | torch.dtype,
    device: torch.device,
    max_model_len: int | None,
    seed: int,
    trust_remote_code: bool,
    quantization: str | None = None,
) -> ModelConfig:
    """Resolve a model name or path into its config (shared by the target and a draft model)."""
    from transformers import AutoConfig

    model_path = resolve_model_path(model)
    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
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
        quantization=resolve_quantization(quantization, model_path, device, resolved_dtype),
    )


@dataclass
class EngineArgs:
    """User-facing engine arguments; field names match vLLM's flags."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    trust_remote_code: bool = False
    quantization: str | None = None
    # {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...} or its JSON
    speculative_config: dict | str | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.spec_decode.config import parse_speculative_config  # imports this module

        device = _resolve_device(self.device)
        _check_quantization(self.quantization, device)
        model_config = build_model_config(
            self.model, self.tokenizer, self.dtype, device, self.max_model_len, self.seed, self.trust_remote_code,
            self.quantization,
        )
        max_model_len = model_config.max_model_len
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
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
        if max_batched is None:
            max_batched = 8192 if self.enable_chunked_prefill else max(8192, max_model_len)
        if max_batched < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_batched}")
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled; a long prompt could never run"
            )

        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
            ),
            device_config=DeviceConfig(device=device),
            speculative_config=parse_speculative_config(
                self.speculative_config, model_config, device, self.quantization
            ),
        )

