"""Qwen2: the Llama decoder with biases on the q/k/v projections; and MiMo, Qwen2 with
multi-token-prediction layers that only the `mtp` drafter reads (spec_decode/mtp.py)."""

from collections.abc import Iterable

import torch

from pagedllm.model_executor.models.llama import LlamaForCausalLM

MTP_PREFIX = "model.mtp_layers."  # MiMo's MTP layers in its checkpoint


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class MiMoForCausalLM(Qwen2ForCausalLM):
    """The target without its MTP layers: their tensors are left to the drafter."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, t) for n, t in weights if not n.startswith(MTP_PREFIX))
