"""A prompt and its images → token ids with one placeholder run per image, and each image's
processed arrays, through the checkpoint's own transformers processor.

Each image goes through the processor's image processor alone (so a repeated image is taken from
the cache of processed images, by content hash), and the processor's `replace_image_token` says
what its placeholder expands to (LLaVA: one `<image>` per patch; Qwen2-VL: one `<|image_pad|>`
per merged patch; Gemma 3: `<start_of_image>`, 256 soft tokens, `<end_of_image>`). The prompt's
i-th placeholder becomes image i's expansion; the tokens that take the image's embeddings are its
run of the embedding token (the processor's `image_token_ids`: LLaVA's `<image>` again, Gemma 3's
`<image_soft_token>`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.multimodal.cache import LRUBytesCache
from pagedllm.multimodal.image import hash_image, load_image
from pagedllm.protocol import MultiModalFeature, TensorData


def to_tensor_data(array: np.ndarray) -> TensorData:
    array = np.ascontiguousarray(array)
    return TensorData(array.dtype.name, list(array.shape), array.tobytes())


def from_tensor_data(data: TensorData) -> np.ndarray:
    return np.frombuffer(data.data, dtype=np.dtype(data.dtype)).reshape(data.shape)


@dataclass(slots=True)
class ProcessedImage:
    identifier: str
    replacement: str  # what the prompt's placeholder becomes
    num_embeds: int  # image tokens in it: one per embedding
    data: dict[str, TensorData]


class MultiModalProcessor:
    """The front end's image processing for one model (its `limit_mm_per_prompt` included)."""

    def __init__(self, model_path: str, tokenizer: Any, model_type: str, limit_per_prompt: dict[str, int],
                 cache_bytes: int, trust_remote_code: bool = False) -> None:
        self.hf_processor = load_hf_processor(model_path, trust_remote_code)
        if not hasattr(self.hf_processor, "replace_image_token") or not getattr(self.hf_processor, "image_token", None):
            raise ValueError(f"{model_path}: its processor ({type(self.hf_processor).__name__}) does not say how "
                             "images expand into placeholder tokens (transformers >= 5 processors do)")
        self.tokenizer = tokenizer
        self.model_type = model_type
        # The prompt's placeholder, and the token that takes an embedding in the expansion: the
        # same for LLaVA (<image>); Gemma 3 writes <start_of_image> and expands it to soft tokens.
        self.image_token: str = self.hf_processor.image_token
        self.image_token_id = self._token_id(model_path, self.image_token)
        embed_ids = [i for i in (getattr(self.hf_processor, "image_token_ids", None) or []) if i is not None]
        self.embed_token_id: int = embed_ids[0] if embed_ids else self.image_token_id
        self.embed_token: str = tokenizer.convert_ids_to_tokens(self.embed_token_id)
        self.limit_per_prompt = limit_per_prompt
        self.cache = LRUBytesCache(cache_bytes)

    def _token_id(self, model_path: str, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == getattr(self.tokenizer, "unk_token_id", None):
            raise ValueError(f"{model_path}: the image token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    # ---- one image ----------------------------------------------------------
    def process_image(self, image: Any) -> ProcessedImage:
        ident = hash_image(image, self.model_type)
        cached = self.cache.get(ident)
        if cached is not None:
            return cached
        try:
            out = self.hf_processor.image_processor(images=[image], return_tensors="np")
            replacement = self.hf_processor.replace_image_token(out, image_idx=0)
        except ValueError:
            raise
        except Exception as e:  # an image the processor cannot take (e.g. too small to resize) is the caller's
            raise ValueError(f"the image processor failed on a {image.width}x{image.height} image: {e}") from None
        data = {k: to_tensor_data(np.asarray(v)) for k, v in out.items() if isinstance(v, np.ndarray)}
        num_embeds = replacement.count(self.embed_token)
        processed = ProcessedImage(ident, replacement, num_embeds, data)
        self.cache.put(ident, processed, sum(len(t.data) for t in data.values()))
        return processed

    # ---- a prompt -----------------------------------------------------------
    def process(self, text: str | None, token_ids: list[int] | None, images: list[Any],
                add_special_tokens: bool = True) -> tuple[list[int], list[MultiModalFeature]]:
        """The expanded token ids and the images' features. `text` is tokenized here; given only
        `token_ids`, each image's placeholder token there is expanded in place."""
        limit = self.limit_per_prompt.get("image", 1)
        if len(images) > limit:
            raise ValueError(f"{len(images)} images in one prompt; at most {limit} are allowed "
                             "(limit_mm_per_prompt / --limit-mm-per-prompt)")
        processed = [self.process_image(load_image(img, f"image {i}")) for i, img in enumerate(images)]
        if text is not None:
            found = text.count(self.image_token)
            if found != len(images):
                raise ValueError(f"the prompt has {found} image placeholders ({self.image_token}) for {len(images)} "
                                 f"images; put one {self.image_token} where each image goes")
            parts = text.split(self.image_token)
            expanded = parts[0] + "".join(p.replacement + rest for p, rest in zip(processed, parts[1:]))
            token_ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens).input_ids
        else:
            token_ids = self._expand_ids(list(token_ids or []), processed)
        return token_ids, self._features(token_ids, processed)

    def _expand_ids(self, token_ids: list[int], processed: list[ProcessedImage]) -> list[int]:
        where = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(where) != len(processed):
            raise ValueError(f"the prompt's token ids hold {len(where)} image tokens ({self.image_token_id}) for "
                             f"{len(processed)} images; one per image, where it goes")
        out: list[int] = []
        prev = 0
        for pos, p in zip(where, processed):
            out += token_ids[prev:pos]
            out += self.tokenizer(p.replacement, add_special_tokens=False).input_ids
            prev = pos + 1
        return out + token_ids[prev:]

    def _features(self, token_ids: list[int], processed: list[ProcessedImage]) -> list[MultiModalFeature]:
        """Image i takes the i-th group of `num_embeds` image tokens, which must be one run."""
        positions = np.flatnonzero(np.asarray(token_ids) == self.embed_token_id)
        if len(positions) != sum(p.num_embeds for p in processed):
            raise ValueError(f"the prompt holds {len(positions)} image tokens ({self.embed_token}) where its "
                             f"{len(processed)} images need {sum(p.num_embeds for p in processed)}: do not write "
                             "image tokens yourself, one placeholder per image")
        features = []
        start = 0
        for p in processed:
            run = positions[start : start + p.num_embeds]
            if run[-1] - run[0] + 1 != p.num_embeds:
                raise ValueError("an image's placeholder tokens are not one run in the prompt")
            features.append(MultiModalFeature("image", p.identifier, int(run[0]), p.num_embeds, p.data))
            start += p.num_embeds
        return features


def load_hf_processor(model_path: str, trust_remote_code: bool = False) -> Any:
    """The checkpoint's transformers processor. One whose video half needs torchvision (Qwen2-VL's;
    torchvision's wheels do not load beside a CPU-only torch build) is built without that half:
    the same processor class, for images only."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).model_type
    base = getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])

    class ImageOnlyProcessor(base):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return ImageOnlyProcessor(image_processor=AutoImageProcessor.from_pretrained(model_path), tokenizer=tokenizer,
                              video_processor=None, chat_template=getattr(tokenizer, "chat_template", None))


@functools.cache
def image_placeholder(model_path: str, trust_remote_code: bool = False) -> str:
    """The text a prompt holds where an image goes (the processor's image token: LLaVA's
    "<image>"), for chat rendering; read once per model."""
    token = getattr(load_hf_processor(model_path, trust_remote_code), "image_token", None)
    if not token:
        raise ValueError(f"{model_path}: its processor names no image token")
    return token
