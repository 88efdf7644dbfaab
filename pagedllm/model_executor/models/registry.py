"""Model classes keyed by the HF `architectures` name in config.json: pagedllm's own, and those a
user registers (`ModelRegistry.register_model`, as in vLLM) without forking the project.

A registration reaches the engine-core and worker processes through the environment
(PAGEDLLM_OOT_MODELS, a JSON map of architecture → "module:Class"), so a class must be importable
by its module path there; one defined in a script's `__main__` works in-process only (LLM with the
default uni executor)."""

from __future__ import annotations

import importlib
import json

from torch import nn

from pagedllm import envs

OOT_MODELS_ENV = "PAGEDLLM_OOT_MODELS"

# architecture → (module under pagedllm.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "MiMoForCausalLM": ("qwen2", "MiMoForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "LlamaForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForSequenceClassification"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
}


_OOT_CLASSES: dict[str, type[nn.Module]] = {}  # registered as classes, in this process


def _oot_specs() -> dict[str, str]:
    try:
        specs = json.loads(envs.PAGEDLLM_OOT_MODELS or "{}")
    except ValueError:
        return {}
    return specs if isinstance(specs, dict) else {}


class ModelRegistry:
    @staticmethod
    def register_model(architecture: str, model_cls: type[nn.Module] | str) -> None:
        """Serve `architecture` (config.json's `architectures[0]`) with `model_cls`: a class, or
        "module:Class". It needs pagedllm's model interface: `__init__(hf_text_config)`,
        `forward(input_ids, positions, intermediate_tensors=None)` returning hidden states,
        `compute_logits(hidden)` and `load_weights(weights) -> loaded names`."""
        if isinstance(model_cls, str):
            if ":" not in model_cls:
                raise ValueError(f"a model class path is 'module:Class', got {model_cls!r}")
            spec = model_cls
        elif isinstance(model_cls, type):
            _OOT_CLASSES[architecture] = model_cls
            spec = f"{model_cls.__module__}:{model_cls.__qualname__}"
        else:
            raise ValueError(f"register_model takes a class or 'module:Class', got {type(model_cls).__name__}")
        specs = _oot_specs()
        specs[architecture] = spec
        envs.set_variable(OOT_MODELS_ENV, json.dumps(specs))

    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted(set(_MODELS) | set(_oot_specs()) | set(_OOT_CLASSES))

    @staticmethod
    def is_supported(architecture: str) -> bool:
        return architecture in _MODELS or architecture in _OOT_CLASSES or architecture in _oot_specs()

    @staticmethod
    def resolve_model_cls(architecture: str) -> type[nn.Module]:
        if architecture in _OOT_CLASSES:
            return _OOT_CLASSES[architecture]
        spec = _oot_specs().get(architecture)
        if spec is not None:
            module, _, name = spec.partition(":")
            if module == "__main__" and architecture not in _OOT_CLASSES:
                raise ValueError(f"model class {spec} for {architecture!r} was defined in a script's __main__, "
                                 "which other processes cannot import: define it in a module")
            obj = importlib.import_module(module)
            for part in name.split("."):
                obj = getattr(obj, part)
            return obj
        if architecture not in _MODELS:
            raise ValueError(
                f"model architecture {architecture!r} is not supported; "
                f"supported: {', '.join(ModelRegistry.get_supported_archs())} "
                "(or register your own with pagedllm.ModelRegistry.register_model)"
            )
        module, cls = _MODELS[architecture]
        return getattr(importlib.import_module(f"pagedllm.model_executor.models.{module}"), cls)


get_supported_archs = ModelRegistry.get_supported_archs
resolve_model_cls = ModelRegistry.resolve_model_cls
