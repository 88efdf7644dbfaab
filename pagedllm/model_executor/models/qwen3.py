"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys."""

from pagedllm.model_executor.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
