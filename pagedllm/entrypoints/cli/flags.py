"""argparse flags generated from a dataclass's fields, so that a setting is declared once: its
name, type, default and help text, with its CLI extras in the field's metadata ("help",
"choices", "aliases", "parse": a function from the text, "flag": another name than
--field-name, "metavar"). A boolean gets its --no- form; a tuple field takes one or more values."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any


def _flag_type(annotation: Any) -> tuple[type, bool]:
    """(int, float, str or bool; whether it takes several values) for a field's annotation:
    `int | None` is int, `tuple[str, ...]` several str, a dict-or-JSON field the JSON text."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(annotation) if a is not type(None)] if union else [annotation]
    if len(args) == 1 and typing.get_origin(args[0]) is tuple:
        inner = typing.get_args(args[0])[0]
        return (inner if inner in (int, float, str) else str), True
    return (args[0] if len(args) == 1 and args[0] in (int, float, str, bool) else str), False


def _parser_of(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def run(value: str) -> Any:
        try:
            return parse(value)
        except ValueError as e:  # argparse prints the message as a usage error
            raise argparse.ArgumentTypeError(str(e)) from None

    return run


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, only: Iterable[str] | None = None) -> None:
    """One flag per field of `cls` that declares a help text (those named in `only`, when given),
    its value at the field's name."""
    hints = typing.get_type_hints(cls)
    wanted = set(only) if only is not None else None
    for field in dataclasses.fields(cls):
        if "help" not in field.metadata or (wanted is not None and field.name not in wanted):
            continue  # not a flag (another dataclass's flag fills it), or not wanted here
        meta = field.metadata
        names = [meta.get("flag") or f"--{field.name.replace('_', '-')}", *meta.get("aliases", ())]
        kind, several = _flag_type(hints[field.name])
        options: dict[str, Any] = {"default": field.default, "help": meta["help"], "dest": field.name}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = _parser_of(meta["parse"]) if "parse" in meta else kind
            for key in ("choices", "metavar"):
                if key in meta:
                    options[key] = list(meta[key]) if key == "choices" else meta[key]
            if several:
                options["nargs"] = meta.get("nargs", "+")  # "*": the flag alone gives an empty list
        parser.add_argument(*names, **options)


def values_of(cls: type, ns: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` the namespace holds, a several-valued flag's list as a tuple."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
