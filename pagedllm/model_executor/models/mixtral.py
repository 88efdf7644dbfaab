"""Mixtral: the Llama decoder with a sparse mixture of experts in place of each MLP.

Published checkpoints name the block `block_sparse_moe` and each expert's gate/down/up
matrices `experts.<id>.w1/w2/w3`; transformers keeps the block as `mlp` with the experts stacked
(`experts.gate_up_proj`, `experts.down_proj`). Both load: the block is `mlp` here."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.model_executor.layers.fused_moe import ExpertRouter, SparseMoeBlock
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.utils import load_weights

MIXTRAL_SHARDS = {"w1": "w1", "w3": "w3", "w2": "w2"}


def num_experts_of(config: Any) -> int:
    """Mixtral calls it num_local_experts, Qwen3-MoE num_experts (transformers maps the one to the other)."""
    n = getattr(config, "num_experts", None)
    return n if n is not None else config.num_local_experts


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        # Mixtral always renormalizes the top-k routing weights.
        return SparseMoeBlock(c.hidden_size, num_experts_of(c), c.num_experts_per_tok, c.intermediate_size,
                              True, c.hidden_act)

    def load_weights(self, weights) -> set[str]:
        router = ExpertRouter(MIXTRAL_SHARDS, rename=(".block_sparse_moe.", ".mlp."))
        loaded = load_weights(self, weights, router)
        router.check(self)
        return loaded
