"""CLI flags for EngineArgs, shared by `generate`, `bench` and `serve`: generated from the dataclass's
fields, so a setting is declared once (name, default, help, choices) in engine/arg_utils.py."""

from __future__ import annotations

import argparse

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli.config_file import add_config_arg
from pagedllm.entrypoints.cli.flags import add_dataclass_flags, values_of


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """One flag per `EngineArgs` field (`--field-name`), with the help text, choices and aliases
    the field declares; a boolean also gets its `--no-` form."""
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, help="model path or name")
    add_config_arg(parser)
    add_dataclass_flags(parser, EngineArgs)


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    values = values_of(EngineArgs, ns)
    if getattr(ns, "model_tag", None):
        values["model"] = ns.model_tag
    return EngineArgs(**values)
