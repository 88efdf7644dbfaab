"""Gemma 3 with images (`Gemma3ForConditionalGeneration`, the 4B-27B checkpoints): a SigLIP
vision tower, Gemma 3's projector (the patch grid average-pooled to `mm_tokens_per_image`
tokens, an RMSNorm, one matrix) and the Gemma 3 decoder.

Tower and projector are transformers' own modules, replicated on every tensor-parallel rank, as
LLaVA's are. Unlike LLaVA, an image's soft tokens attend to each other both ways (the reference's
mask during the prompt): `is_mm_prefix_lm` makes the scheduler compute each image's placeholders
in one step and the attention take each image's span as bidirectional (forward_context
`PrefillSegment.bidirectional`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.models.llava import LlavaForConditionalGeneration, text_model_for, vision_tower_for


class Gemma3ForConditionalGeneration(LlavaForConditionalGeneration):
    is_mm_prefix_lm = True

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.config = config
        self.vision_tower = vision_tower_for(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.language_model = text_model_for(config.text_config, max_model_len)

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One [mm_tokens_per_image, hidden] tensor per image (every image is resized to the
        tower's size), all images in one tower pass. They go in unscaled: the decoder's
        sqrt(hidden) scale applies to token embeddings only, as in the reference."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.cat([item["pixel_values"] for item in items]).to(weight)
        hidden = self.vision_tower(pixel_values=pixels).last_hidden_state
        return list(self.multi_modal_projector(hidden))
