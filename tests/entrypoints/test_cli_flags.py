"""The flags are generated from dataclass fields (entrypoints/cli/flags.py): every `EngineArgs`
field and every `ServerConfig` field with a help text is a flag, the defaults are the
dataclass's, and aliases, choices, booleans, byte sizes and several-valued flags parse."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace
from pagedllm.entrypoints.cli.main import build_parser
from pagedllm.entrypoints.openai.server_config import LoRAModulePath, ServerConfig


def _parse(*argv: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_positional=True)
    return engine_args_from_namespace(parser.parse_args(list(argv)))


def test_every_field_is_a_flag_with_help_and_the_dataclass_default():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {a.dest: a for a in parser._actions}
    for field in dataclasses.fields(EngineArgs):
        assert field.metadata.get("help"), f"EngineArgs.{field.name} has no help text"
        action = flags[field.name]
        assert f"--{field.name.replace('_', '-')}" in action.option_strings
        assert action.help == field.metadata["help"]
    assert _parse() == EngineArgs()


def test_each_kind_of_flag_parses():
    args = _parse("m.gguf", "-tp", "2", "-q", "int8", "--kv-cache-memory", "1.5GiB", "--no-enable-prefix-caching",
                  "--enforce-eager", "--gpu-memory-utilization", "0.5", "--max-model-len", "4096",
                  "--speculative-config", '{"method": "ngram"}', "--distributed-executor-backend", "mp")
    assert args.model == "m.gguf" and args.tensor_parallel_size == 2 and args.quantization == "int8"
    assert args.kv_cache_memory == int(1.5 * 2**30) and args.enable_prefix_caching is False
    assert args.enforce_eager is True and args.gpu_memory_utilization == 0.5 and args.max_model_len == 4096
    assert args.speculative_config == '{"method": "ngram"}' and args.distributed_executor_backend == "mp"


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-memory", "lots"], "not a byte size: 'lots'"),
    (["--quantization", "int3"], "invalid choice: 'int3'"),
    (["--max-num-seqs", "many"], "invalid int value"),
])
def test_a_bad_value_is_a_usage_error_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert message in capsys.readouterr().err


def _serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_serve_has_a_flag_for_every_server_setting_and_its_defaults():
    parser = argparse.ArgumentParser()
    from pagedllm.entrypoints.cli.flags import add_dataclass_flags

    add_dataclass_flags(parser, ServerConfig)
    dests = {a.dest for a in parser._actions}
    flagged = {f.name for f in dataclasses.fields(ServerConfig) if "help" in f.metadata}
    assert flagged == dests - {"help"} and "reasoning_parser" not in flagged  # EngineArgs' flag fills that one
    assert ServerConfig.from_namespace(_serve()) == ServerConfig()


def test_server_flags_parse_into_the_config():
    ns = _serve("--served-model-name", "a", "b", "--lora-modules", "x=/p", '{"name": "y", "path": "/q"}',
                "--enable-lora", "--port", "9000", "--no-disable-log-stats", "--metrics-compat", "vllm",
                "--allowed-origins", "http://a", "--reasoning-parser", "qwen3")
    config = ServerConfig.from_namespace(ns)
    assert config.served_model_names == ("a", "b") and config.port == 9000 and config.metrics_compat == "vllm"
    assert config.lora_modules == (LoRAModulePath("x", "/p"), LoRAModulePath("y", "/q"))
    assert config.allowed_origins == ("http://a",) and config.reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        ServerConfig.from_namespace(_serve("--lora-modules", "x=/p"))


def test_run_batch_takes_the_batch_settings_of_the_server_only():
    ns = build_parser().parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--served-model-name", "m",
                                    "--tool-call-parser", "hermes"])
    config = ServerConfig.from_namespace(ns)
    assert config.served_model_names == ("m",) and config.tool_call_parser == "hermes" and config.port == 8000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run-batch", "-i", "a", "-o", "b", "--port", "1"])
