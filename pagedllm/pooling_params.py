"""PoolingParams: what a pooling request (embed, encode) asks of the pooled hidden states, in
vLLM's names. Plain data, so it crosses process boundaries with the request."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "encode", "classify")


@dataclass
class PoolingParams:
    # None: the model's default (its pooler config; sentence-transformers models say in modules.json).
    normalize: bool | None = None
    # Matryoshka truncation of an embedding to its first `dimensions` values (then normalized).
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")


def pair_up(firsts: list, seconds: list) -> tuple[list, list]:
    """vLLM's score pairing: one first text against every second one, or two lists of equal length
    pair by pair."""
    if not firsts or not seconds:
        raise ValueError("text_1 and text_2 must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many as "
                         "text_2")
    return firsts, seconds


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0


def cross_encoder_prompt(tokenizer, text_1: str, text_2: str) -> dict:
    """A text pair as a cross-encoder reads it: the tokenizer's pair encoding ([CLS] a [SEP] b
    [SEP] for BERT) with its token type ids."""
    if not isinstance(text_1, str) or not isinstance(text_2, str):
        raise ValueError("a cross-encoder scores pairs of texts, not token ids")
    enc = tokenizer(text_1, text_2)
    prompt = {"prompt_token_ids": list(enc["input_ids"])}
    if enc.get("token_type_ids") is not None:
        prompt["token_type_ids"] = list(enc["token_type_ids"])
    return prompt
