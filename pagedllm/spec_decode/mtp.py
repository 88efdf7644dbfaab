"""MTP drafts: the multi-token-prediction layer a checkpoint ships beside its own layers, run as an
EAGLE-style head (`EagleProposer`, method "mtp"). MiMo's layout (`model.mtp_layers.{i}.*` in the
target's own checkpoint, vLLM's `MiMoMTP`):

    x = input_proj([hidden_layernorm(target hidden p); token_layernorm(embed(token p + 1))])
    out = final_layernorm(decoder_layer(x))      # a Qwen2 layer of the target's shape

and the target's LM head turns `out` into the draft for token p + 2; chained drafts feed `out`
back as the hidden state. The embedding at position 0 is zeroed, as MiMo trained it. Only layer 0
is used, for every chained draft, as vLLM does.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq
from pagedllm.model_executor.models.llama import LlamaDecoderLayer, head_dim_of
from pagedllm.model_executor.models.qwen2 import MTP_PREFIX
from pagedllm.model_executor.models.utils import PACKED_MODULES, building_in, load_weights

MTP_ARCHITECTURES = ("MiMoForCausalLM",)
_OWN_PARTS = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")  # the rest: its decoder layer


def mtp_config(target: ModelConfig, model: str | None) -> Any:
    """The target's text config, checked to carry MTP layers this drafter runs; `model` (optional
    in speculative_config) must name the target itself."""
    if model is not None and model not in (target.model, target.model_path):
        raise ValueError(f"speculative_config: method 'mtp' drafts with the target's own MTP layers; 'model' "
                         f"must be the target ({target.model!r}) or left out, got {model!r}")
    text = target.text_config
    if target.architecture not in MTP_ARCHITECTURES:
        raise ValueError(f"speculative method 'mtp' runs the MTP layers of {', '.join(MTP_ARCHITECTURES)} "
                         f"checkpoints; {target.architecture or target.model} is not one")
    if not getattr(text, "num_nextn_predict_layers", 0):
        raise ValueError(f"speculative method 'mtp': {target.model} has no MTP layers (num_nextn_predict_layers "
                         "is 0 or absent in its config.json)")
    return text


class MTPHead(nn.Module):
    """One MTP layer: returns its normed output, which is both the draft's hidden state (to the
    target's LM head) and the next chained draft's input."""

    packed_modules_mapping = PACKED_MODULES
    embed_tokens = None  # the target's embedding is shared

    def __init__(self, config: Any, max_model_len: int) -> None:
        super().__init__()
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        inv_freq, scaling = compute_inv_freq(config, head_dim_of(config), max_model_len=max_model_len)
        rotary = RotaryEmbedding(inv_freq, config.max_position_embeddings, scaling)
        self.layer = LlamaDecoderLayer(config, 0, rotary, True, False)
        self.final_layernorm = RMSNorm(h, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        x = torch.cat((self.hidden_layernorm(hidden.to(embeds.dtype)), self.token_layernorm(embeds)), dim=-1)
        return self.final_layernorm(self.layer(positions, self.input_proj(x)))


def _mtp_tensors(model_path: str) -> dict[str, torch.Tensor]:
    """Layer 0's tensors from the target's safetensors files, named as MTPHead's parameters."""
    from safetensors import safe_open

    from pagedllm.transformers_utils.weight_utils import safetensors_files

    prefix = MTP_PREFIX + "0."
    tensors = {}
    for file in safetensors_files(model_path):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    part = name.removeprefix(prefix)
                    tensors[part if part.startswith(_OWN_PARTS) else "layer." + part] = f.get_tensor(name)
    if not tensors:
        raise ValueError(f"speculative method 'mtp': no {prefix}* tensors in the safetensors files of "
                         f"{os.path.basename(model_path.rstrip('/'))}")
    return tensors


def load_mtp_head(model_path: str, config: Any, dtype: torch.dtype, device: torch.device,
                  max_model_len: int) -> MTPHead:
    with building_in(dtype, device):
        head = MTPHead(config, max_model_len)
    try:
        load_weights(head, _mtp_tensors(model_path).items())
    except ValueError as e:
        raise ValueError(f"speculative method 'mtp', the MTP layer of {model_path!r}: {e}") from None
    return head.eval()
