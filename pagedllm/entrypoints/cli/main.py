"""The `pagedllm` command: serve, generate, run-batch, chat, complete, bench, collect-env."""

from __future__ import annotations

import argparse
import sys

from pagedllm.engine.core_launch import discard_prestarted_core, prestart_core
from pagedllm.version import __version__


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.entrypoints.cli.bench import add_bench_parser
    from pagedllm.entrypoints.cli.chat import add_chat_parsers
    from pagedllm.entrypoints.cli.collect_env import add_collect_env_parser
    from pagedllm.entrypoints.cli.config_file import FlexibleArgumentParser
    from pagedllm.entrypoints.cli.generate import add_generate_parser
    from pagedllm.entrypoints.cli.run_batch import add_run_batch_parser
    from pagedllm.entrypoints.cli.serve import add_serve_parser

    # Subparsers inherit the class: each command with engine flags also takes --config FILE.yaml.
    parser = FlexibleArgumentParser(prog="pagedllm", description="LLM inference on a paged KV cache")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    add_run_batch_parser(sub)
    add_chat_parsers(sub)
    add_collect_env_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command's exit status. `pagedllm serve` run as the program (`argv` None) ends the
    process itself once the server has shut down (pagedllm/process_exit.py)."""
    if argv is None and sys.argv[1:2] == ["serve"]:
        from pagedllm.process_exit import exit_process

        exit_process(_main(sys.argv[1:]))
    return _main(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["serve"] and not {"-h", "--help"} & set(argv):
        # The engine-core process imports torch and transformers beside this one, which is
        # about to do the same; it waits for its arguments (engine/core_launch.py).
        prestart_core()
    try:
        args = build_parser().parse_args(argv)
        try:
            return int(args.func(args) or 0)
        except ValueError as e:  # bad input: one clear line, no traceback
            print(f"error: {e}", file=sys.stderr)
            return 2
    finally:
        discard_prestarted_core()  # when the command did not take it (a bad flag, a failed start)


if __name__ == "__main__":
    sys.exit(main())
