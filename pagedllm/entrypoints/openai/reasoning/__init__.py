"""Reasoning parsers: split a reasoning model's thinking (`reasoning_content`) from its answer (`content`).

`ReasoningParserManager.get(name)` gives the class for `--reasoning-parser name`; importing this package
registers the built-in ones (deepseek_r1, qwen3).
"""

from pagedllm.entrypoints.openai.reasoning import deepseek_r1, qwen3  # noqa: F401
from pagedllm.entrypoints.openai.reasoning.abstract import ReasoningParser, ReasoningParserManager

__all__ = ["ReasoningParser", "ReasoningParserManager"]
