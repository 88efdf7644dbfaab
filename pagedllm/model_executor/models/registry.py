"""Model classes keyed by the HF `architectures` name in config.json."""

from __future__ import annotations

import importlib

from torch import nn

# architecture → (module under pagedllm.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "LlamaForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForSequenceClassification"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
}


def get_supported_archs() -> list[str]:
    return sorted(_MODELS)


def resolve_model_cls(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(get_supported_archs())}"
        )
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(f"pagedllm.model_executor.models.{module}"), cls)
