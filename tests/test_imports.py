"""Every module of the package imports, and every third-party module the package (or this suite)
imports, at the top or inside a function, belongs to a distribution pyproject.toml declares, so a
fresh `pip install -e ".[test]"` has everything the code needs."""

from __future__ import annotations

import ast
import functools
import importlib
import pkgutil
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

import pagedllm

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"pagedllm", "tests"}


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(pagedllm.__path__, prefix="pagedllm."))


@pytest.mark.parametrize("name", _modules())
def test_module_imports(name: str) -> None:
    importlib.import_module(name)


def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _declared() -> tuple[set[str], set[str]]:
    """(main dependencies with the named feature extras such as `ray`, test extra), as normalized
    distribution names. A feature extra is imported only where its feature is used."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {_normalize(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in reqs}

    extras = project["optional-dependencies"]
    features = {name for extra, reqs in extras.items() if extra != "test" for name in names(reqs)}
    return names(project["dependencies"]) | features, names(extras.get("test", []))


def _third_party_imports(directory: Path) -> dict[str, set[str]]:
    """Top-level module name -> files importing it, for every absolute import in the tree."""
    found: dict[str, set[str]] = {}
    for path in directory.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()  # reads every installed distribution's file list


def _distributions(module: str) -> set[str]:
    """The distributions providing `module` (by its own name when none installed provides it)."""
    return {_normalize(d) for d in _packages_distributions().get(module, [module])}


@pytest.mark.parametrize(("directory", "extras"), [("pagedllm", False), ("tests", True)])
def test_third_party_imports_are_declared(directory: str, extras: bool) -> None:
    main, test = _declared()
    allowed = main | test if extras else main
    missing = {
        module: sorted(files)
        for module, files in _third_party_imports(ROOT / directory).items()
        if not _distributions(module) & allowed
    }
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
