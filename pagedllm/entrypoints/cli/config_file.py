"""`--config FILE.yaml`: flags from a YAML mapping, overridden by the command line.

The parser class is inherited by every subparser, so the leaf parser of the command (`serve`,
`bench throughput`, ...) sees its own argv with `--config` in it. The file's values go into
the namespace before parsing, each through its flag's own action and type, so a command-line
flag overrides them and a positional argument can never be swallowed by a list from the file.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from typing import Any

CONFIG_FLAG = "--config"


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(CONFIG_FLAG, default=None, metavar="FILE.yaml",
                        help="read flags from a YAML mapping (keys as flag names, e.g. 'max-model-len: 512'); "
                             "flags on the command line override it")


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that honours `--config` where the parser defines it."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        original = list(sys.argv[1:] if args is None else args)
        path, argv = _pop_config(original)
        if path is None or CONFIG_FLAG not in self._option_string_actions:
            return super().parse_known_args(original, namespace)
        namespace = namespace if namespace is not None else argparse.Namespace()
        for action, option, values in self._config_items(load_config(path, self._config_error), path, argv):
            try:
                action(self, namespace, self._get_values(action, values) if action.nargs != 0 else None, option)
            except argparse.ArgumentError as e:
                self._config_error(f"{path}: {option[2:]}: {e.message}")
            except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
                self._config_error(f"{path}: {option[2:]}: {e}")
            action.required = False  # satisfied by the file
        namespace.config = path
        return super().parse_known_args(argv, namespace)

    def _config_error(self, message: str) -> None:
        """Exit 2 with the message alone: the usage of a long command would bury it."""
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _config_items(self, config: dict[str, Any], path: str,
                      argv: list[str]) -> list[tuple[argparse.Action, str, list[str]]]:
        """(action, option string, argument strings) for each key of the file."""
        items = []
        for key, value in config.items():
            option = "--" + str(key).strip().lstrip("-").replace("_", "-")
            action = self._option_string_actions.get(option)
            if action is None or option == CONFIG_FLAG:
                flags = [o[2:] for o in self._option_string_actions if o.startswith("--") and o != CONFIG_FLAG]
                close = difflib.get_close_matches(option[2:], flags, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f"; see '{self.prog} --help'"
                self._config_error(f"unknown key {key!r} in config file {path}: '{self.prog}' has no {option}{hint}")
            if value is None:
                continue
            if isinstance(action, argparse.BooleanOptionalAction):
                if not isinstance(value, bool):
                    self._config_error(f"{path}: {key!r}: expected true or false, got {value!r}")
                items.append((action, option if value else "--no-" + option[2:], []))
            elif action.nargs == 0:  # store_true and the like
                if not isinstance(value, bool):
                    self._config_error(f"{path}: {key!r}: expected true or false, got {value!r}")
                if value:
                    items.append((action, option, []))
            elif isinstance(action, argparse._AppendAction):
                if _given(action, argv):  # the command line's list replaces the file's, not extends it
                    continue
                items.extend((action, option, [_text(v)]) for v in (value if isinstance(value, list) else [value]))
            elif action.nargs in ("+", "*") or isinstance(action.nargs, int):
                items.append((action, option, [_text(v) for v in (value if isinstance(value, list) else [value])]))
            elif isinstance(value, list):
                self._config_error(f"{path}: {key!r} takes one value, got a list")
            else:
                items.append((action, option, [_text(value)]))
        return items


def load_config(path: str, error: Any = None) -> dict[str, Any]:
    """The YAML file as a mapping; `error` (a parser's) reports a problem, else ValueError."""
    import yaml

    def fail(message: str) -> None:
        if error is not None:
            error(message)
        raise ValueError(message)

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as e:
        fail(f"cannot read config file {path}: {e.strerror}")
    except yaml.YAMLError as e:
        fail(f"config file {path} is not valid YAML: {e}")
    if config is None:
        return {}
    if not isinstance(config, dict):
        fail(f"config file {path} must hold a mapping of flag names to values, not a {type(config).__name__}")
    return config


def _text(value: Any) -> str:
    """A YAML value as the command line would spell it: mappings and lists as JSON (the form
    --speculative-config, --pooler-config and --lora-modules take), booleans as true/false."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _given(action: argparse.Action, argv: list[str]) -> bool:
    return any(a in action.option_strings or a.split("=", 1)[0] in action.option_strings for a in argv)


def _pop_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --config path, argv without it); the last one wins, as for any flag."""
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        if arg == CONFIG_FLAG and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith(CONFIG_FLAG + "="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest
