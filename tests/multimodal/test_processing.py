"""Prompt + images → token ids and features, against the checkpoint's own transformers processor."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.multimodal.image import hash_image, load_image
from pagedllm.multimodal.processing import MultiModalProcessor, from_tensor_data
from tests.utils import data_url, random_image


@pytest.fixture(scope="module")
def processor(tiny_llava):
    from transformers import AutoTokenizer

    return MultiModalProcessor(tiny_llava, AutoTokenizer.from_pretrained(tiny_llava), "llava", {"image": 3}, 1 << 30)


def test_same_ids_and_pixels_as_the_hf_processor(processor, tiny_llava):
    from transformers import AutoProcessor

    text = "user: <image> and <image><image>\nthree? assistant:"
    images = [random_image(s, 30 + 10 * s, 40) for s in (1, 2, 3)]
    ref = AutoProcessor.from_pretrained(tiny_llava)(text=text, images=images, return_tensors="np")
    ids, features = processor.process(text, None, images)
    assert ids == ref["input_ids"][0].tolist()
    assert [(f.offset, f.length) for f in features] == [(5, 16), (23, 16), (39, 16)]
    for f, pixels in zip(features, ref["pixel_values"]):
        np.testing.assert_array_equal(from_tensor_data(f.data["pixel_values"])[0], pixels)
    # Token ids with one image token per image expand to the same.
    short = processor.tokenizer(text).input_ids
    assert processor.process(None, short, images)[0] == ids


def test_content_hash_is_the_pixels(processor):
    img = random_image(4)
    assert hash_image(load_image(data_url(img))) == hash_image(img)
    assert hash_image(img) != hash_image(random_image(5))
    processor.process("<image>", None, [img])
    hits = processor.cache.hits
    _, [f] = processor.process("again <image>", None, [load_image(data_url(img))])
    assert processor.cache.hits == hits + 1 and f.identifier == hash_image(img, "llava")


@pytest.mark.parametrize("images, text, message", [
    (4, "<image>" * 4, "at most 3 are allowed"),
    (1, "none", "1 images; put one <image>"),
    (0, "<image>", "0 images"),
])
def test_errors(processor, images, text, message):
    with pytest.raises(ValueError, match=message):
        processor.process(text, None, [random_image(i) for i in range(images)])


def test_unreadable_and_empty_images():
    with pytest.raises(ValueError, match="cannot read the image"):
        load_image(b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(ValueError, match="expected a PIL image"):
        load_image(3)
