"""ServerConfig: every option of `pagedllm serve` the HTTP server reads (the app and uvicorn),
typed, with the CLI's defaults. `from_namespace` is the one place that reads the argparse
Namespace; the engine's own options go through EngineArgs instead. Imports nothing heavy:
the CLI parser takes its defaults from here."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
MAX_PARALLEL_TOOL_CALLS = 8
DEFAULT_MAX_TOOL_OUTPUT_BYTES = 1024 * 1024
DEFAULT_MAX_CONVERSATION_ITEMS = 1000
DEFAULT_MAX_CONVERSATION_ITEM_BYTES = 1024 * 1024
DEFAULT_LOG_STATS_INTERVAL_S = 10.0
METRICS_COMPAT_CHOICES = ("vllm",)  # --metrics-compat: whose metric names /metrics repeats its series under


@dataclass(slots=True, frozen=True)
class LoRAModulePath:
    """A LoRA adapter served from the start (`--lora-modules`): clients name it as a model."""

    name: str
    path: str
    base_model_name: str | None = None  # the model card's parent; default: the first served name


def parse_lora_module(value: str) -> LoRAModulePath:
    """One `--lora-modules` value: `name=path`, or vLLM's JSON object
    `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = value.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules {value!r}: invalid JSON: {e}") from None
        if not isinstance(spec, dict) or set(spec) - {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(
                f"--lora-modules {value!r}: a JSON object takes only the keys name, path, base_model_name")
        name, path, base = spec.get("name"), spec.get("path"), spec.get("base_model_name")
        if not all(isinstance(v, str) and v for v in (name, path)) or not isinstance(base, (str, type(None))):
            raise argparse.ArgumentTypeError(
                f"--lora-modules {value!r}: name and path must be non-empty strings, base_model_name a string")
        return LoRAModulePath(name, path, base or None)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"--lora-modules {value!r}: expected name=path or a JSON object")
    return LoRAModulePath(name.strip(), path.strip())


@dataclass(slots=True)
class ServerConfig:
    # the app (api_server.build_app)
    served_model_names: tuple[str, ...] = ()  # empty: the model argument
    chat_template: str | None = None  # a file path or inline Jinja, read once at start
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_choice_auto_grammar: bool = False
    max_parallel_tool_calls: int = MAX_PARALLEL_TOOL_CALLS
    reasoning_parser: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    api_key: str | None = None
    metrics_no_auth: bool = False
    allowed_origins: tuple[str, ...] = ()  # each space- or comma-separated, or a JSON list
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info
    lora_modules: tuple[LoRAModulePath, ...] = ()  # registered with the engine at start (needs --enable-lora)
    # the Responses and Conversations APIs
    responses_store: str | None = None  # None or "memory": in this process; "sqlite:///file.db": on disk
    responses_store_max_entries: int = 1000
    responses_store_ttl: float | None = None  # seconds after its last write a stored response expires
    disable_responses_store: bool = False
    max_tool_output_bytes: int = DEFAULT_MAX_TOOL_OUTPUT_BYTES
    max_conversation_items: int = DEFAULT_MAX_CONVERSATION_ITEMS  # 400 past them
    max_conversation_item_bytes: int = DEFAULT_MAX_CONVERSATION_ITEM_BYTES  # JSON bytes of one item
    # logs and metrics
    log_stats_interval: float = DEFAULT_LOG_STATS_INTERVAL_S  # seconds between stats lines
    disable_log_stats: bool = False
    enable_log_requests: bool = False
    max_log_len: int | None = None  # characters of prompt text (and prompt token ids) a request line shows
    metrics_compat: str | None = None  # "vllm": /metrics repeats every series under vLLM's names
    # the HTTP server (cli/serve.py: serve_http)
    host: str = "0.0.0.0"
    port: int = 8000
    limit_concurrency: int | None = None  # None: from the open-file limit
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    timeout_keep_alive: int = 5
    uvicorn_log_level: str = "info"

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ServerConfig:
        """From `pagedllm serve`'s parsed arguments (after run_serve filled api_key from the environment)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        values["served_model_names"] = tuple(args.served_model_name or ())
        values["allowed_origins"] = tuple(args.allowed_origins or ())
        values["lora_modules"] = tuple(getattr(args, "lora_modules", None) or ())
        if values["lora_modules"] and not getattr(args, "enable_lora", False):
            raise ValueError("--lora-modules needs --enable-lora")
        if values.get("log_stats_interval", 1) <= 0:
            raise ValueError("--log-stats-interval must be positive (turn the lines off with --disable-log-stats)")
        if (values.get("max_log_len") or 0) < 0:
            raise ValueError("--max-log-len must not be negative")
        return cls(**values)
