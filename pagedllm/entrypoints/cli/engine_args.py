"""CLI flags for EngineArgs, shared by `generate`, `bench` and `serve`: generated from the dataclass's
fields, so a setting is declared once (name, default, help, choices) in engine/arg_utils.py."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli.config_file import add_config_arg


def _flag_type(annotation: Any) -> type:
    """int, float or str for a field's annotation (`int | None` is int; a dict-or-JSON field takes
    the JSON text)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return args[0] if len(args) == 1 and args[0] in (int, float, str, bool) else str


def _parser_of(parse: Any) -> Any:
    def run(value: str) -> Any:
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return run


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """One flag per `EngineArgs` field (`--field-name`), with the help text, choices and aliases
    the field declares; a boolean also gets its `--no-` form."""
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, help="model path or name")
    add_config_arg(parser)
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        meta = field.metadata
        names = [f"--{field.name.replace('_', '-')}", *meta.get("aliases", ())]
        kind = _flag_type(hints[field.name])
        options: dict[str, Any] = {"default": field.default, "help": meta["help"], "dest": field.name}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = _parser_of(meta["parse"]) if "parse" in meta else kind
            if "choices" in meta:
                options["choices"] = list(meta["choices"])
        parser.add_argument(*names, **options)


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    values = {name: getattr(ns, name) for name in EngineArgs.field_names() if hasattr(ns, name)}
    if getattr(ns, "model_tag", None):
        values["model"] = ns.model_tag
    return EngineArgs(**values)
