"""The processed-image caches: LRU by bytes, and the client / core pair that keep the same
entries in the same order, so an image's arrays cross the process boundary once."""

from __future__ import annotations

import msgspec
import pytest

from pagedllm.multimodal.cache import LRUBytesCache, MirroredReceiver, MirroredSender
from pagedllm.protocol import EngineCoreRequest, MultiModalFeature, TensorData
from pagedllm.sampling_params import SamplingParams


def feature(ident: str, nbytes: int) -> MultiModalFeature:
    return MultiModalFeature("image", ident, 0, 1, {"pixel_values": TensorData("uint8", [nbytes], bytes(nbytes))})


def test_lru_evicts_oldest_by_bytes():
    cache = LRUBytesCache(100)
    cache.put("a", 1, 40)
    cache.put("b", 2, 40)
    assert cache.get("a") == 1  # a is now the newest
    cache.put("c", 3, 40)
    assert "b" not in cache and "a" in cache and "c" in cache
    cache.put("huge", 4, 101)  # larger than the whole cache: not kept
    assert "huge" not in cache and cache.size == 80


def test_mirrored_caches_send_each_image_once_and_agree():
    """A stream of requests through msgspec (as over ZMQ): a repeat is sent without its arrays
    while the core still has them, and the core fills in exactly what was sent before."""
    sender, receiver = MirroredSender(250), MirroredReceiver(250)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreRequest)
    stream = ["a", "b", "a", "c", "d", "a", "b", "e", "e"]  # 100 bytes each: two fit
    sent_whole = []
    for i, ident in enumerate(stream):
        req = EngineCoreRequest(f"r{i}", [1], SamplingParams(), [2], 0.0, mm_features=[feature(ident, 100)])
        stripped = sender.strip(req.mm_features)
        sent_whole.append(stripped[0].data is not None)
        req.mm_features = stripped
        got = decoder.decode(encoder.encode(req))
        filled = receiver.fill(got.mm_features)
        assert filled[0].data["pixel_values"].data == bytes(100)
        assert list(sender.cache.entries) == list(receiver.cache.entries)
    assert sent_whole == [True, True, False, True, True, True, True, True, False]


def test_receiver_refuses_an_unknown_stripped_image():
    with pytest.raises(RuntimeError, match="no copy"):
        MirroredReceiver(100).fill([MultiModalFeature("image", "x", 0, 1, None)])
