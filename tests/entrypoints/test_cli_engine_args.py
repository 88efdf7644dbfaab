"""The engine flags are generated from `EngineArgs`' fields: every field is a flag with its help
text, the defaults are the dataclass's, and aliases, choices, booleans and byte sizes parse."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace


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
