"""Imports between pagedllm's top-level packages go down the layers, never up, and never in a cycle.

The order, bottom to top, and why:

- `version`, `logger`, `cpu_isa`, `sampling_params`, `outputs`: plain helpers and user-facing data; import nothing
  of pagedllm's.
- `protocol`: the messages that cross the front / engine-core boundary; carries `SamplingParams`.
- `transformers_utils`: model files (the default model, name/path resolution, GGUF conversion,
  tokenizer, safetensors reading); config and model code both need them, so they sit beneath both.
- `config`: describes and validates what the engine runs (including speculative decoding).
- `multimodal`: images into prompts (loading, hashing, the checkpoint's processor, the processed-image
  caches shared by the front end and the engine core); the front end, the core and the worker use it.
- `distributed`: the ranks' process groups and collectives (torch.distributed), which the
  tensor-parallel layers call.
- `forward_context`: the per-step attention metadata the model's layers read.
- `model_executor`: layers, models, loader; knows tensors, not requests.
- `structured_output`: grammars and their compilation, used by the scheduler.
- `spec_decode`: speculative decoding in one package: the proposers (n-gram, draft model), the
  verification (rejection sampler), the scheduler's draft rules, the counters and the
  draft-making tool. The model runner hands the draft model its step-input builder, so the
  package sits below the scheduler and the worker that both use it.
- `core`: requests, scheduler, KV cache manager; knows tokens and blocks, never tensors.
- `worker`: the model runner and the proposers; turns a scheduler output into a forward pass.
- `executor`: how the engine core reaches the workers (`collective_rpc`), in its process or others.
- `engine`: the engine core, its process and client, the front ends (`LLMEngine`, `AsyncLLM`).
- `entrypoints`: `LLM`, the CLI, the OpenAI server, beam search.

`pagedllm/__init__.py` re-exports the public names and may import anything, so nothing inside
the package imports it (`from pagedllm import LLM` would run the whole package from any layer);
`from pagedllm import cpu_isa` names a module and counts as importing it. Imports inside
functions and under `TYPE_CHECKING` count like the others: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pagedllm

LAYERS = [
    "version",
    "envs",
    "cache_files",
    "process_exit",
    "logger",
    "cpu_isa",
    "cpu_malloc",
    "sampling_params",
    "pooling_params",
    "lora_request",
    "outputs",
    "protocol",
    "transformers_utils",
    "config",
    "multimodal",
    "distributed",
    "forward_context",
    "model_executor",
    "lora",
    "structured_output",
    "spec_decode",
    "core",
    "worker",
    "executor",
    "engine",
    "entrypoints",
]
RANK = {name: i for i, name in enumerate(LAYERS)}
ROOT = Path(pagedllm.__file__).parent


def _module_parts(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_module(name: str) -> bool:
    return (ROOT / f"{name}.py").exists() or (ROOT / name / "__init__.py").exists()


def _imported(path: Path, text: str | None = None) -> list[tuple[int, str]]:
    """(line, dotted module) for each pagedllm module a file imports, relative imports resolved;
    `from pagedllm import x` counts as importing `pagedllm.x`."""
    parts = _module_parts(path)
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            if base == "pagedllm":  # a submodule by name, or a name the package re-exports
                found += [(node.lineno, f"pagedllm.{alias.name}" if _is_module(alias.name) else "pagedllm")
                          for alias in node.names]
            else:
                found.append((node.lineno, base))
    return [(line, name) for line, name in found if name.split(".")[0] == "pagedllm"]


def _edges() -> list[tuple[str, str | None, str]]:
    """(source top-level package, imported top-level package or None for the root, where) for every
    cross-package import."""
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = _module_parts(path)
        if len(parts) < 2:
            continue  # pagedllm/__init__.py: the public re-exports
        src = parts[1]
        for line, name in _imported(path):
            dst = name.split(".")[1] if "." in name else None
            if dst != src:
                edges.append((src, dst, f"{path.relative_to(ROOT.parent)}:{line} imports {name}"))
    return edges


def test_every_top_level_package_has_a_layer():
    names = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert names <= set(LAYERS), f"place these in LAYERS: {sorted(names - set(LAYERS))}"


def test_nothing_inside_imports_the_package_root():
    root = [where for _, dst, where in _edges() if dst is None]
    assert not root, "imports of pagedllm/__init__.py from inside the package:\n" + "\n".join(root)


def test_no_import_goes_up_a_layer():
    upward = [where for src, dst, where in _edges() if dst is not None and RANK[dst] > RANK[src]]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_cycle_between_top_level_packages():
    graph: dict[str, set[str]] = {}
    for src, dst, _ in _edges():
        if dst is not None:
            graph.setdefault(src, set()).add(dst)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)):
                return True
        return False

    cycles = sorted(pkg for pkg in graph if reaches(pkg, pkg, set()))
    assert not cycles, f"packages in an import cycle: {cycles}"


def _module_graph() -> dict[str, set[str]]:
    """module -> the pagedllm modules it imports (a name inside a module resolves to the module);
    a package's own `__init__` and the package root are left out (re-exports)."""
    modules = {".".join(_module_parts(p)) for p in ROOT.rglob("*.py")}

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        src = ".".join(_module_parts(path))
        for _, name in _imported(path):
            dst = resolve(name)
            if dst and dst != "pagedllm" and dst != src and not src.startswith(dst + "."):
                graph.setdefault(src, set()).add(dst)
    return graph


def test_no_cycle_between_modules():
    """Not even through a lazy or TYPE_CHECKING import: a module that needs a name from one that
    imports it shows a piece living in the wrong file."""
    graph = _module_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "modules in an import cycle:\n" + "\n".join(cycles)


def _environ_uses(path: Path, text: str | None = None) -> list[int]:
    """Lines of `os.environ` / `os.getenv` (however imported) in a file."""
    tree = ast.parse(path.read_text() if text is None else text)
    lines = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
             and isinstance(node.value, ast.Name) and node.value.id == "os"]
    lines += [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "os"
              and any(alias.name in ("environ", "getenv") for alias in node.names)]
    return lines


def test_only_envs_reads_the_environment():
    """Every variable is declared once, with its meaning and default, in pagedllm/envs.py."""
    found = [f"{path.relative_to(ROOT.parent)}:{line}" for path in sorted(ROOT.rglob("*.py"))
             if path.name != "envs.py" or path.parent != ROOT for line in _environ_uses(path)]
    assert not found, "os.environ outside pagedllm/envs.py:\n" + "\n".join(found)
    assert _environ_uses(ROOT / "x.py", "import os\nfrom os import getenv\nos.environ.get('A')\n") == [3, 2]


def test_every_pagedllm_variable_named_in_the_package_is_declared():
    import re

    from pagedllm import envs

    named = {m for path in ROOT.rglob("*.py") for m in re.findall(r"\"(PAGEDLLM_[A-Z0-9_]+)\"", path.read_text())}
    assert "PAGEDLLM_CPU_KERNELS" in named
    assert named <= set(envs.environment_variables), sorted(named - set(envs.environment_variables))
    for name in [*envs.environment_variables, *envs.OTHER_VARIABLES]:
        getattr(envs, name)  # each reads without error, set or not
    with pytest.raises(KeyError, match="not declared"):
        envs.set_variable("PAGEDLLM_NOT_A_SETTING", "1")


def test_the_platform_choice_is_made_in_custom_op_only():
    """Layers pick their kernels through `custom_op` (vLLM's CustomOp dispatch, `platform_of`,
    `CustomFn`), never by asking `cpu_kernels.usable` themselves."""
    home = {ROOT / "model_executor" / "custom_op.py", ROOT / "model_executor" / "layers" / "cpu_kernels.py"}
    found = [f"{path.relative_to(ROOT.parent)}:{node.lineno}" for path in sorted(ROOT.rglob("*.py"))
             if path not in home for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "usable"]
    assert not found, "kernel choices outside model_executor/custom_op.py:\n" + "\n".join(found)


def _scheduler_uses(text: str) -> list[tuple[int, str]]:
    """(line, attribute) of every `<...>.scheduler.<attribute>` and `scheduler.<attribute>`."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute):
            inner = node.value
            named = (isinstance(inner, ast.Attribute) and inner.attr == "scheduler") or \
                (isinstance(inner, ast.Name) and inner.id == "scheduler")
            if named:
                found.append((node.lineno, node.attr))
    return found


def test_outside_core_a_scheduler_is_used_through_its_interface_only():
    from pagedllm.core.interface import SchedulerInterface

    allowed = {name for name in dir(SchedulerInterface) if not name.startswith("_")}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if (ROOT / "core") in path.parents:
            continue
        text = path.read_text()
        found += [f"{path.relative_to(ROOT.parent)}:{line} .{attr}" for line, attr in _scheduler_uses(text)
                  if attr not in allowed]
        found += [f"{path.relative_to(ROOT.parent)}:{line} imports {name}" for line, name in _imported(path, text)
                  if name == "pagedllm.core.scheduler_state"]
    assert not found, "scheduler internals used outside core/:\n" + "\n".join(found)
    assert _scheduler_uses("self.scheduler.running\nscheduler.schedule()\n") == [(1, "running"), (2, "schedule")]


def test_the_check_sees_lazy_and_relative_imports():
    """The scanner itself: imports inside a function, under TYPE_CHECKING and relative ones are found."""
    src = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedllm.engine import x\n"
        "from ..worker import model_runner\n"
        "def f():\n    from pagedllm.entrypoints.llm import LLM\n"
    )
    found = {name for _, name in _imported(ROOT / "core" / "probe.py", src)}
    assert found == {"pagedllm.engine", "pagedllm.worker", "pagedllm.entrypoints.llm"}

