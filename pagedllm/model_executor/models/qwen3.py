"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys."""

from pagedllm.model_executor.models.llama import LlamaForCausalLM, LlamaForSequenceClassification


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    qk_norm = True
