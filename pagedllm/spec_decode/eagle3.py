"""EAGLE-3 heads: one decoder layer over [embedding; hidden] (2H wide into attention) fed first
with the target's residual stream at three of its layers (low, middle, high) fused by `fc`, then
with its own outputs; it has its own final norm and LM head over a smaller draft vocabulary,
whose ids map to the target's through `d2t`.

The Hub layout (`yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`): a Llama `config.json` with
`draft_vocab_size` (and optionally `eagle_config.eagle_aux_hidden_state_layer_ids`), and
`fc.weight` [H, 3H], `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v take 2H), `midlayer.mlp.*`, `norm.weight`,
`lm_head.weight` [draft vocabulary, H], `d2t` (target id = draft id + d2t[draft id]) and `t2d`,
in `model.safetensors` or `pytorch_model.bin`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import Linear, QKVParallelLinear
from pagedllm.model_executor.layers.quantization import int4_kernels_take, quantize_weight
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq
from pagedllm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.model_executor.loader.quantize import linear_max_rows
from pagedllm.model_executor.models.llama import LlamaAttention, head_dim_of, llama_mlp
from pagedllm.model_executor.models.utils import PACKED_MODULES, building_in, load_weights
from pagedllm.spec_decode.head_files import load_head_tensors

EAGLE3_FILES = ("model.safetensors", "pytorch_model.bin")


def aux_layer_ids(config: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input (the residual stream) the head reads, in layer order: the
    config's `eagle_config.eagle_aux_hidden_state_layer_ids`, else vLLM's default (2, L // 2, L - 3)."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    ids = tuple(ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if not all(isinstance(i, int) and 0 <= i < num_target_layers for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"EAGLE-3 head reads target layers {list(ids)}; the target has {num_target_layers} "
                         "(set eagle_config.eagle_aux_hidden_state_layer_ids in the head's config.json)")
    return tuple(sorted(ids))  # kept in layer order, as vLLM concatenates them


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [norm(embedding); norm(hidden)], the residual
    taken from `hidden`; returns the pre-norm output."""

    def __init__(self, config: Any, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, 0, rotary, False, False)
        attn = self.self_attn
        heads = config.num_attention_heads
        self.self_attn.qkv_proj = QKVParallelLinear(2 * h, attn.head_dim, heads,
                                                    getattr(config, "num_key_value_heads", None) or heads)
        self.mlp = llama_mlp(config)
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        x = hidden + self.self_attn(positions, x)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    packed_modules_mapping = PACKED_MODULES
    tied_weight_names = ("embed_tokens.weight", "target.lm_head.weight")  # the head's own lm_head always loads

    def __init__(self, config: Any, num_aux: int, own_embedding: bool, max_model_len: int) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h) if own_embedding else None
        self.fc = Linear(num_aux * h, h)
        inv_freq, scaling = compute_inv_freq(config, head_dim_of(config), max_model_len=max_model_len)
        self.layer = Eagle3Layer(config, RotaryEmbedding(inv_freq, config.max_position_embeddings, scaling))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = Linear(h, self.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The pre-norm output, from the target's fused layers (wider than H) or the head's own rows."""
        hidden = hidden.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)
        return self.layer(positions, embeds, hidden)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary, from the head's pre-norm output."""
        return self.lm_head(self.norm(out))


def check_eagle3_config(path: str, config: Any) -> None:
    draft = getattr(config, "draft_vocab_size", None) or config.vocab_size
    if not 0 < draft <= config.vocab_size:
        raise ValueError(f"EAGLE-3 head at {path!r}: draft_vocab_size {draft} is not within the vocabulary "
                         f"({config.vocab_size})")


def _expected_tensors() -> list[str]:
    names = ["fc.weight", "norm.weight", "lm_head.weight"]
    names += [f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"]
    names += [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return names + [f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]


def load_eagle3_head(path: str, config: Any, num_aux: int, dtype: torch.dtype, device: torch.device,
                     max_model_len: int, quantization: str | None) -> Eagle3Head:
    """The head, its linears given int4 copies (run for few rows; int8 where a shape's packing
    cannot take int4) where the target is quantized: a draft pass then reads an eighth of the
    float32 bytes. The head's weights are read cold after each target pass, so its bytes are most
    of its cost: on an AVX2 CPU, int4 against int8 copies took 7-8% off the default model's
    batch-1 time a token at k = 2 (docs/spec_decode.md), with as many drafts accepted."""
    tensors = load_head_tensors(path, EAGLE3_FILES, "EAGLE-3 head")
    missing = sorted(set(_expected_tensors()) - set(tensors))
    if missing:
        raise ValueError(f"EAGLE-3 head at {path!r}: missing tensors {missing[:4]}")
    with building_in(dtype, device):
        head = Eagle3Head(config, num_aux, "embed_tokens.weight" in tensors, max_model_len)
    fc = tuple(tensors["fc.weight"].shape)
    if fc != tuple(head.fc.weight.shape):
        raise ValueError(f"EAGLE-3 head at {path!r}: fc.weight is {list(fc)}, expected {list(head.fc.weight.shape)} "
                         f"({num_aux} target layers of {config.hidden_size})")
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)  # the inverse map: not needed to draft
    if d2t is None and head.draft_vocab_size != config.vocab_size:
        raise ValueError(f"EAGLE-3 head at {path!r}: a draft vocabulary of {head.draft_vocab_size} needs 'd2t'")
    if d2t is not None:
        d2t = d2t.to(torch.int64)
        ids = torch.arange(len(d2t)) + d2t
        if d2t.shape != (head.draft_vocab_size,) or ids.min() < 0 or ids.max() >= config.vocab_size:
            raise ValueError(f"EAGLE-3 head at {path!r}: d2t does not map {head.draft_vocab_size} draft ids into "
                             f"the vocabulary of {config.vocab_size}")
        head.d2t.copy_(d2t)
    renamed = ((name.replace("midlayer.", "layer.", 1), t) for name, t in tensors.items())
    try:
        load_weights(head, renamed)
    except ValueError as e:
        raise ValueError(f"EAGLE-3 head at {path!r}: {e}") from None
    if quantization is not None:
        for module in head.modules():
            if isinstance(module, Linear):
                # int4 where pagedllm's kernels take the shape (the copy the decode plans bind), else int8
                method = "int4" if int4_kernels_take(module.weight) else "int8"
                module.quant = quantize_weight(module.weight.data, method, linear_max_rows(module.weight.dtype))
    return head.eval()

