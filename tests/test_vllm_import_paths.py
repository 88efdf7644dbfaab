"""vLLM code ports by renaming the package: every public name `vllm`, `vllm.sampling_params` and
`vllm.outputs` export that pagedllm also has is importable from the same place in pagedllm.

The lists are vLLM's own (`vllm/__init__.py`'s MODULE_ATTRS, the classes of its
`sampling_params.py` and `outputs.py`). A name pagedllm lacks must be in NOT_IN_PAGEDLLM, and
the scan below checks that no module of pagedllm defines it under that name somewhere else."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import pagedllm

VLLM_EXPORTS = {
    "pagedllm": (
        "AsyncEngineArgs", "EngineArgs", "AsyncLLMEngine", "LLMEngine", "LLM", "initialize_ray_cluster",
        "PromptType", "TextPrompt", "TokensPrompt", "ModelRegistry", "SamplingParams", "PoolingParams",
        "ClassificationOutput", "ClassificationRequestOutput", "CompletionOutput", "EmbeddingOutput",
        "EmbeddingRequestOutput", "PoolingOutput", "PoolingRequestOutput", "RequestOutput", "ScoringOutput",
        "ScoringRequestOutput",
    ),
    "pagedllm.sampling_params": (
        "SamplingType", "StructuredOutputsParams", "RepetitionDetectionParams", "RequestOutputKind",
        "SamplingParams", "BeamSearchParams",
    ),
    "pagedllm.outputs": (
        "CompletionOutput", "PoolingOutput", "RequestOutput", "PoolingRequestOutput", "EmbeddingOutput",
        "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
        "ScoringRequestOutput",
    ),
}
# vLLM names with no counterpart here: Ray is started by the executor itself, prompts are plain
# dicts (PromptType), and SamplingType / repetition detection are not implemented.
NOT_IN_PAGEDLLM = frozenset({
    "initialize_ray_cluster", "TextPrompt", "TokensPrompt", "SamplingType", "RepetitionDetectionParams",
})
ROOT = Path(pagedllm.__file__).parent


def _defined_names() -> set[str]:
    """Every class, function and module-level assignment name anywhere in the package."""
    names: set[str] = set()
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


@pytest.mark.parametrize(("module", "name"), [(m, n) for m, names in VLLM_EXPORTS.items() for n in names
                                              if n not in NOT_IN_PAGEDLLM])
def test_vllm_name_imports_from_the_same_place(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is not None


def test_names_left_out_are_not_defined_anywhere() -> None:
    defined = _defined_names()
    assert not NOT_IN_PAGEDLLM & defined, "defined in pagedllm: export them where vLLM does"


def test_root_exports_are_listed_and_resolve_to_the_defining_modules() -> None:
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.processor import PromptType
    from pagedllm.entrypoints import beam_search
    from pagedllm.sampling_params import BeamSearchParams

    assert set(VLLM_EXPORTS["pagedllm"]) - NOT_IN_PAGEDLLM <= set(pagedllm.__all__)
    assert all(getattr(pagedllm, n) is not None for n in pagedllm.__all__)
    assert pagedllm.AsyncLLMEngine is AsyncLLM and pagedllm.AsyncEngineArgs is pagedllm.EngineArgs
    assert pagedllm.PromptType == PromptType
    assert beam_search.BeamSearchParams is BeamSearchParams  # the old place still works
    with pytest.raises(AttributeError):
        pagedllm.NoSuchName  # noqa: B018
