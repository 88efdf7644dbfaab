"""Qwen2: the Llama decoder with biases on the q/k/v projections."""

from pagedllm.model_executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
