"""`--config FILE.yaml` at the parser level: every command with engine flags takes it, the file's
keys become the flags' values (through their own types), and the command line overrides them.
The real `pagedllm serve --config` start is in test_cli_clients.py."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.cli.engine_args import engine_args_from_namespace
from pagedllm.entrypoints.cli.main import build_parser, main
from pagedllm.entrypoints.openai.server_config import LoRAModulePath, ServerConfig

SERVE_YAML = """\
model: /models/a
max-model-len: 512
served_model_name: [a, b]
enable-lora: true
enable-prefix-caching: false
kv-cache-memory: 16MiB
speculative-config: {method: ngram, num_speculative_tokens: 4}
lora-modules: [{name: x, path: /adapters/x}, y=/adapters/y]
port: 9000
allowed-origins: ["https://a.example"]
metrics-no-auth: false
"""


def _parse(tmp_path, text: str, *argv: str):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    return build_parser().parse_args([argv[0], "--config", str(cfg), *argv[1:]])


def test_serve_config_fills_namespace_engine_args_and_server_config(tmp_path):
    args = _parse(tmp_path, SERVE_YAML, "serve")
    assert (args.max_model_len, args.kv_cache_memory, args.port) == (512, 16 << 20, 9000)
    assert args.enable_lora is True and args.enable_prefix_caching is False and args.metrics_no_auth is False
    ea = engine_args_from_namespace(args)
    assert (ea.model, ea.max_model_len, ea.enable_lora, ea.enable_prefix_caching) == ("/models/a", 512, True, False)
    assert ea.speculative_config == '{"method": "ngram", "num_speculative_tokens": 4}'
    sc = ServerConfig.from_namespace(args)
    assert sc.served_model_names == ("a", "b") and sc.port == 9000 and sc.allowed_origins == ("https://a.example",)
    assert sc.lora_modules == (LoRAModulePath("x", "/adapters/x"), LoRAModulePath("y", "/adapters/y"))


def test_command_line_overrides_the_file(tmp_path):
    # The positional model after a list from the file is not swallowed by it.
    args = _parse(tmp_path, SERVE_YAML, "serve", "/models/cli", "--max-model-len", "64", "--enable-prefix-caching",
                  "--served-model-name", "c", "--port", "1", "--long-prefill-token-threshold", "16")
    ea = engine_args_from_namespace(args)
    assert (ea.model, ea.max_model_len, ea.enable_prefix_caching) == ("/models/cli", 64, True)
    assert ea.long_prefill_token_threshold == 16
    assert args.served_model_names == ["c"] and args.port == 1
    assert ea.kv_cache_memory == 16 << 20  # not on the command line: from the file
    # --config=PATH, and flags before it
    cfg = tmp_path / "config.yaml"
    args = build_parser().parse_args(["serve", "--port", "2", f"--config={cfg}"])
    assert args.port == 2 and args.max_model_len == 512


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["bench", "throughput"], ["bench", "latency"],
                                  ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"]])
def test_every_engine_command_takes_it(tmp_path, argv):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-num-seqs: 7\ndtype: float32\nenable_chunked_prefill: false\n")
    args = build_parser().parse_args([*argv, "--config", str(cfg)])
    ea = engine_args_from_namespace(args)
    assert (ea.max_num_seqs, ea.dtype, ea.enable_chunked_prefill) == (7, "float32", False)


def test_required_flags_from_the_file(tmp_path):
    args = _parse(tmp_path, "input-file: in.jsonl\noutput-file: out.jsonl\nmax-concurrency: 3\n", "run-batch")
    assert (args.input_file, args.output_file, args.max_concurrency) == ("in.jsonl", "out.jsonl", 3)


@pytest.mark.parametrize("text, message", [
    ("max-model-length: 512\n", "unknown key 'max-model-length' in config file"),
    ("max-model-length: 512\n", "did you mean 'max-model-len'?"),
    ("dtype: float64\n", "dtype: invalid choice: 'float64'"),
    ("max-model-len: lots\n", "max-model-len: invalid int value: 'lots'"),
    ("enable-lora: maybe\n", "'enable-lora': expected true or false"),
    ("port: [1, 2]\n", "'port' takes one value, got a list"),
    ("- max-model-len\n", "must hold a mapping"),
    ("max-model-len: [\n", "is not valid YAML"),
    ("config: other.yaml\n", "has no --config"),
])
def test_bad_files_are_one_clear_error(tmp_path, capsys, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "pagedllm serve: error:" in err and "usage:" not in err


def test_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(tmp_path / "nope.yaml")])
    assert "cannot read config file" in capsys.readouterr().err


def test_commands_without_engine_flags_do_not_take_it(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("url: http://x\n")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--config", str(cfg)])
    assert "unrecognized arguments: --config" in capsys.readouterr().err


def test_a_repeatable_flag_on_the_command_line_replaces_the_file_list(tmp_path):
    assert _parse(tmp_path, "prompt: [a, b]\n", "generate").prompt == ["a", "b"]
    assert _parse(tmp_path, "prompt: [a, b]\n", "generate", "--prompt", "c").prompt == ["c"]
