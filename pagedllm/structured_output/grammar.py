"""From a StructuredOutputsParams to an xgrammar grammar: validation without a tokenizer
(for the front end) and compilation against the model's vocabulary (in the engine core)."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams


def _choice_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def _schema(spec: str) -> str:
    try:
        json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    return spec


def validate(params: StructuredOutputsParams) -> None:
    """Raise ValueError with the compiler's message if the spec cannot become a grammar.
    Cheap (no vocabulary involved), so the front end can answer 400 before scheduling."""
    import xgrammar as xgr

    kind, spec = params.key()
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(_schema(spec))
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_regex(_choice_regex(params.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except ValueError:
        raise
    except Exception as e:  # xgrammar reports parse errors as RuntimeError
        raise ValueError(f"invalid structured_outputs.{kind}: {_clean(e)}") from None


def _clean(e: Exception) -> str:
    """Drop xgrammar's '[time] file:line:' prefix from its messages."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", msg)


class GrammarCompiler:
    """One per engine: the tokenizer info is built once (about a second for a 262k
    vocabulary), compiled grammars are cached by xgrammar per spec."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size

    def compile(self, params: StructuredOutputsParams) -> Any:
        kind, spec = params.key()
        try:
            if kind == "json":
                if params.disable_any_whitespace:
                    return self.compiler.compile_json_schema(_schema(spec), any_whitespace=False, separators=(",", ":"))
                return self.compiler.compile_json_schema(_schema(spec))
            if kind == "json_object":
                # An object, as vLLM: the builtin JSON grammar would also allow a top-level array.
                return self.compiler.compile_json_schema('{"type": "object"}')
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                return self.compiler.compile_regex(_choice_regex(params.choice))
            return self.compiler.compile_grammar(spec)
        except Exception as e:
            raise ValueError(f"invalid structured_outputs.{kind}: {_clean(e)}") from None
