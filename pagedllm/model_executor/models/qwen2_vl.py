"""Qwen2-VL and Qwen2.5-VL: a native-resolution ViT (an image of any size becomes a grid of
14-px patches, 2x2 of them merged into one token) and a Qwen2 decoder rotated by multimodal RoPE.

The tower is transformers' own module, replicated on every tensor-parallel rank as LLaVA's is.
M-RoPE: an image token's position has three parts (temporal, row, column of its merged patch,
offset by the text before it); a text token's three parts are equal. `get_mrope_input_positions`
gives a prompt's [3, L] positions and the shift of every later token (`delta`: the next text
position minus the token's index), which the runner applies (worker/input_batch.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.model_executor.models.llava import LlavaForConditionalGeneration, ModuleLoader, text_model_for
from pagedllm.protocol import MultiModalFeature


def _vision_tower(config: Any) -> nn.Module:
    if config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Tower
    return Tower._from_config(config.vision_config, dtype=torch.get_default_dtype())


def _grid(feature: MultiModalFeature) -> tuple[int, int, int]:
    from pagedllm.multimodal.processing import from_tensor_data

    t, h, w = (int(x) for x in from_tensor_data(feature.data["image_grid_thw"]).reshape(-1)[:3])
    return t, h, w


class Qwen2VLForConditionalGeneration(LlavaForConditionalGeneration):
    uses_mrope = True

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.visual = _vision_tower(config)
        self.merge = config.vision_config.spatial_merge_size
        text_config = config.text_config
        if not hasattr(text_config, "tie_word_embeddings"):  # transformers 5 keeps it on the outer config
            text_config.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        self.language_model = text_model_for(text_config, max_model_len)

    def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One [merged patches, hidden] tensor per image; the images' patches in one tower pass
        (each image attends within itself)."""
        pixels = torch.cat([item["pixel_values"] for item in items]).to(self.visual.dtype)
        grid = torch.cat([item["image_grid_thw"].reshape(-1, 3) for item in items])
        merged = self.visual(pixels, grid_thw=grid).pooler_output
        return list(merged.split((grid.prod(-1) // self.merge**2).tolist()))

    def get_mrope_input_positions(self, token_ids: list[int],
                                  features: list[MultiModalFeature]) -> tuple[np.ndarray, int]:
        """The prompt's [3, L] M-RoPE positions, and the shift of every token after it."""
        out = np.empty((3, len(token_ids)), np.int64)
        pos = i = 0  # the next text position, the next token index
        for f in features:
            n = f.offset - i
            out[:, i : f.offset] = np.arange(pos, pos + n)
            pos += n
            t, h, w = _grid(f)
            h, w = h // self.merge, w // self.merge
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            out[:, f.offset : f.offset + f.length] = np.stack([tt, hh, ww]).reshape(3, -1) + pos
            pos += max(h, w)
            i = f.offset + f.length
        out[:, i:] = np.arange(pos, pos + len(token_ids) - i)
        return out, int(out.max(initial=-1)) + 1 - len(token_ids)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Both layouts of the checkpoint names: `visual.*` / `model.*` / `lm_head.*` (the released
        checkpoints) and transformers 5's `model.visual.*` / `model.language_model.*`."""
        tower = ModuleLoader(self.visual, "visual")

        def text_weights():
            for name, tensor in weights:
                if name.startswith(("visual.", "model.visual.")):
                    tower.load(name.split("visual.", 1)[1], tensor)
                elif name.startswith("model.language_model."):
                    yield "model." + name.removeprefix("model.language_model."), tensor
                elif name.startswith(("model.", "lm_head.")):
                    yield name, tensor
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")

        loaded = self.language_model.load_weights(text_weights())
        tower.check()
        return loaded


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the tower has window attention and a gated MLP (transformers' module)."""
