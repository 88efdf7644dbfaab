"""Phi-3: the Llama decoder, stored with fused `qkv_proj` and `gate_up_proj` tensors and often with
LongRoPE (rotary_embedding.longrope_inv_freq), a partial rotary factor or a sliding window.

The fused tensors are cut into their q/k/v (gate/up) parts at load time, so each part reaches its
shard of the stacked parameter and is split over the tensor-parallel ranks like Llama's."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedllm.model_executor.models.llama import LlamaForCausalLM, head_dim_of
from pagedllm.model_executor.models.utils import load_weights, split_fused


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        config = self.config
        head_dim = head_dim_of(config)
        q = config.num_attention_heads * head_dim
        kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
        inter = config.intermediate_size
        fused = {
            "qkv_proj": (("q_proj", "k_proj", "v_proj"), (q, kv, kv)),
            "gate_up_proj": (("gate_proj", "up_proj"), (inter, inter)),
        }
        return load_weights(self, split_fused(weights, fused))
