"""ServerConfig: every option of `pagedllm serve` the HTTP server reads (the app and uvicorn),
typed, each field declaring its flag (default, help, choices), from which
entrypoints/cli/flags.py generates the CLI. `from_namespace` is the one place that reads the
argparse Namespace; the engine's own options go through EngineArgs instead. Imports nothing
heavy: the CLI parser is built from here."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.cli.flags import values_of

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


def _flag(default: Any, help: str, **cli: Any) -> Any:
    """A field that is also a `pagedllm serve` flag (entrypoints/cli/flags.py generates it)."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


@dataclass(slots=True)
class ServerConfig:
    # the app (api_server.build_app)
    served_model_names: tuple[str, ...] = _flag((), "model name(s) clients use; default: the model argument",
                                                flag="--served-model-name", metavar="NAME")
    chat_template: str | None = _flag(None, "Jinja chat template, as a file path or inline text (read once at start)")
    trust_request_chat_template: bool = _flag(False, "accept a `chat_template` (Jinja text, never a path) in "
                                                     "requests; default: 400")
    tool_call_parser: str | None = _flag(None, "hermes, llama3_json, mistral or pythonic")
    enable_auto_tool_choice: bool = _flag(False, 'let the model decide to call tools (tool_choice "auto"); needs '
                                                 "--tool-call-parser")
    tool_choice_auto_grammar: bool = _flag(
        False, 'tool_choice "auto" under a grammar: plain text or one call in the --tool-call-parser\'s markup '
               "(hermes unless given; not pythonic), so a model never tuned for tools can call them; implies "
               "--enable-auto-tool-choice")
    max_parallel_tool_calls: int = _flag(MAX_PARALLEL_TOOL_CALLS, 'most calls the grammar allows for tool_choice '
                                         '"required" unless parallel_tool_calls is false (then one) (default: '
                                         "%(default)s)")
    reasoning_parser: str | None = None  # EngineArgs' --reasoning-parser
    max_request_body_bytes: int = _flag(DEFAULT_MAX_REQUEST_BODY_BYTES, "larger request bodies get 413 before they "
                                        "are parsed (default: %(default)s)")
    api_key: str | None = _flag(None, "require 'Authorization: Bearer <key>' on every route but /health (default: "
                                      "$PAGEDLLM_API_KEY)")
    metrics_no_auth: bool = _flag(False, "with --api-key, leave /metrics open for scrapers (default: it needs the "
                                         "key too)")
    allowed_origins: tuple[str, ...] = _flag((), "CORS origins to allow (space- or comma-separated, or a JSON "
                                                 "list); default: no CORS headers")
    enable_tokenizer_info_endpoint: bool = _flag(
        False, "serve GET /tokenizer_info: the tokenizer's configuration (special tokens, class, chat template; "
               "never file paths), as clients with a remote tokenizer (lm-eval) read it")
    lora_modules: tuple[LoRAModulePath, ...] = _flag(
        (), "LoRA adapters (PEFT directories) served from the start, each a model name clients may use: name=path "
            'or JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'; needs --enable-lora',
        parse=parse_lora_module, metavar="NAME=PATH")
    # the Responses and Conversations APIs
    responses_store: str | None = _flag(None, "where /v1/responses keeps stored responses and conversations: "
                                              "'memory' (default) or 'sqlite:///relative.db' / "
                                              "'sqlite:////absolute/path.db', which survives a restart")
    responses_store_max_entries: int = _flag(1000, "stored responses (and, separately, conversations) kept; the "
                                                   "oldest written goes first (default: %(default)s)")
    responses_store_ttl: float | None = _flag(None, "seconds a stored response or conversation lives after its last "
                                                    "write; a background response still running past it is "
                                                    "cancelled (default: no expiry)")
    disable_responses_store: bool = _flag(False, "store nothing: store=true and background responses get 400, "
                                                 "conversations are off")
    max_tool_output_bytes: int = _flag(DEFAULT_MAX_TOOL_OUTPUT_BYTES, "largest output one POST "
                                       "/v1/responses/{id}/tool_outputs may carry (default: %(default)s)")
    max_conversation_items: int = _flag(DEFAULT_MAX_CONVERSATION_ITEMS, "most items one conversation holds; adding "
                                        "past it is a 400 (default: %(default)s)")
    max_conversation_item_bytes: int = _flag(DEFAULT_MAX_CONVERSATION_ITEM_BYTES, "largest conversation item (its "
                                             "JSON, in bytes); a larger one is a 400 (default: %(default)s)")
    # logs and metrics
    log_stats_interval: float = _flag(DEFAULT_LOG_STATS_INTERVAL_S, "seconds between the stats lines (throughput, "
                                      "running / waiting requests, KV cache and prefix cache use) (default: "
                                      "%(default)s)")
    disable_log_stats: bool = _flag(False, "no periodic stats lines")
    enable_log_requests: bool = _flag(False, "log each generation request as it arrives: id, prompt length, "
                                             "sampling params, prompt")
    max_log_len: int | None = _flag(None, "with --enable-log-requests, the most prompt characters (and prompt "
                                          "token ids) a line shows (default: all)")
    metrics_compat: str | None = _flag(None, "vllm: /metrics also exposes every series under vLLM's names "
                                             "(vllm:num_requests_running, ...), so dashboards written for vLLM "
                                             "work unchanged", choices=METRICS_COMPAT_CHOICES)
    # the HTTP server (cli/serve.py: serve_http)
    host: str = _flag("0.0.0.0", "address to bind (default: all interfaces)")
    port: int = _flag(8000, "port to listen on (default: %(default)s)")
    limit_concurrency: int | None = _flag(None, "open connections (and in-flight requests) beyond which new ones "
                                                "get 503; default: the open-file limit (raised to its hard "
                                                "maximum) less 256")
    header_timeout: float = _flag(DEFAULT_HEADER_TIMEOUT_S, "seconds a connection may take to send a complete "
                                  "request head (default: %(default)s)")
    timeout_keep_alive: int = _flag(5, "seconds an idle keep-alive connection stays open (default: %(default)s)")
    uvicorn_log_level: str = _flag("info", "uvicorn's log level (server events, access log); pagedllm's own lines "
                                           "follow $PAGEDLLM_LOGGING_LEVEL (default INFO)",
                                   choices=("critical", "error", "warning", "info", "debug", "trace"))

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ServerConfig:
        """From `pagedllm serve`'s parsed arguments (after run_serve filled api_key from the environment)."""
        values = values_of(cls, args)
        if values.get("lora_modules") and not getattr(args, "enable_lora", False):
            raise ValueError("--lora-modules needs --enable-lora")
        if values.get("log_stats_interval", 1) <= 0:
            raise ValueError("--log-stats-interval must be positive (turn the lines off with --disable-log-stats)")
        if (values.get("max_log_len") or 0) < 0:
            raise ValueError("--max-log-len must not be negative")
        return cls(**values)
