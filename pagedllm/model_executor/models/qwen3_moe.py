"""Qwen3-MoE: Qwen3's attention (q/k norm) with a sparse mixture of experts in the layers the
config makes sparse (every `decoder_sparse_step`-th, except `mlp_only_layers`, which keep a
dense MLP of `intermediate_size`); experts are `moe_intermediate_size` wide."""

from __future__ import annotations

from torch import nn

from pagedllm.model_executor.layers.fused_moe import ExpertRouter, SparseMoeBlock
from pagedllm.model_executor.models.llama import llama_mlp
from pagedllm.model_executor.models.mixtral import num_experts_of
from pagedllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from pagedllm.model_executor.models.utils import load_weights

QWEN_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        experts = num_experts_of(c)
        step = getattr(c, "decoder_sparse_step", 1) or 1
        if layer_idx in (getattr(c, "mlp_only_layers", None) or []) or experts == 0 or (layer_idx + 1) % step:
            return llama_mlp(c)
        return SparseMoeBlock(c.hidden_size, experts, c.num_experts_per_tok, c.moe_intermediate_size,
                              bool(getattr(c, "norm_topk_prob", False)), c.hidden_act)

    def load_weights(self, weights) -> set[str]:
        router = ExpertRouter(QWEN_SHARDS)
        loaded = load_weights(self, weights, router)
        router.check(self)
        return loaded
