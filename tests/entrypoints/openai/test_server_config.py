"""ServerConfig from `pagedllm serve`'s arguments, and the scripted engine as an EngineClient."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.cli.main import build_parser
from pagedllm.entrypoints.openai.server_config import LoRAModulePath, ServerConfig


def test_cli_defaults_are_the_config_defaults():
    assert ServerConfig.from_namespace(build_parser().parse_args(["serve", "/m"])) == ServerConfig()


def test_every_server_flag_reaches_the_config():
    args = build_parser().parse_args([
        "serve", "/m", "--host", "127.0.0.1", "--port", "9", "--api-key", "k", "--metrics-no-auth",
        "--served-model-name", "a", "b", "--chat-template", "t.jinja", "--trust-request-chat-template",
        "--max-request-body-bytes", "100", "--limit-concurrency", "7", "--header-timeout", "2.5",
        "--timeout-keep-alive", "3", "--allowed-origins", "http://x", "http://y", "--enable-auto-tool-choice",
        "--tool-call-parser", "mistral", "--tool-choice-auto-grammar", "--max-parallel-tool-calls", "2",
        "--reasoning-parser", "qwen3", "--uvicorn-log-level", "warning", "--enable-tokenizer-info-endpoint",
        "--responses-store", "sqlite:///r.db", "--responses-store-max-entries", "5", "--responses-store-ttl", "60",
        "--disable-responses-store", "--max-tool-output-bytes", "99", "--max-conversation-items", "7",
        "--max-conversation-item-bytes", "88", "--enable-lora", "--lora-modules", "a=/p",
        "--log-stats-interval", "2.5", "--disable-log-stats", "--enable-log-requests", "--max-log-len", "40",
        "--metrics-compat", "vllm"])
    config = ServerConfig.from_namespace(args)
    assert config == ServerConfig(
        served_model_names=("a", "b"), chat_template="t.jinja", trust_request_chat_template=True,
        tool_call_parser="mistral", enable_auto_tool_choice=True, tool_choice_auto_grammar=True,
        max_parallel_tool_calls=2, reasoning_parser="qwen3", max_request_body_bytes=100, api_key="k",
        metrics_no_auth=True, allowed_origins=("http://x", "http://y"), enable_tokenizer_info_endpoint=True,
        responses_store="sqlite:///r.db", responses_store_max_entries=5, responses_store_ttl=60.0,
        disable_responses_store=True, max_tool_output_bytes=99, max_conversation_items=7,
        max_conversation_item_bytes=88, lora_modules=(LoRAModulePath("a", "/p"),),
        log_stats_interval=2.5, disable_log_stats=True, enable_log_requests=True, max_log_len=40,
        metrics_compat="vllm",
        host="127.0.0.1", port=9,
        limit_concurrency=7, header_timeout=2.5, timeout_keep_alive=3, uvicorn_log_level="warning")
    changed = {f.name for f in dataclasses.fields(ServerConfig)
               if getattr(config, f.name) != getattr(ServerConfig(), f.name)}
    assert changed == {f.name for f in dataclasses.fields(ServerConfig)}  # the test sets every field


@pytest.mark.parametrize("flags", [["--log-stats-interval", "0"], ["--max-log-len", "-1"]])
def test_log_flags_are_checked(flags):
    with pytest.raises(ValueError):
        ServerConfig.from_namespace(build_parser().parse_args(["serve", "/m", *flags]))


def test_config_is_slotted():
    with pytest.raises(AttributeError):
        ServerConfig().no_such_option = 1


def test_fake_engine_is_an_engine_client(fake_engine):
    assert isinstance(fake_engine, EngineClient) and fake_engine.is_running
