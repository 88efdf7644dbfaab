"""The scheduler's encoder budget and encoder cache: an image is encoded in the step whose tokens
first reach its placeholders, its embeddings are held while any scheduled chunk still needs them,
and evictions reach the workers before they could be missed. A fake worker replays every step
message (through msgspec) and checks that each scheduled placeholder's image is held."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.protocol import MultiModalFeature
from tests.core.conftest import BS, Driver, make_req


def make_scheduler(*, encoder_budget: int = 64, encoder_cache: int = 64, num_blocks: int = 64,
                   max_num_batched_tokens: int = 64, threshold: int = 0, prefix_caching: bool = True,
                   whole_images: bool = False) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=128,
                        long_prefill_token_threshold=threshold, max_num_encoder_input_tokens=encoder_budget,
                        encoder_cache_size=encoder_cache, disable_chunked_mm_input=whole_images),
        CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
    )


def mm_req(req_id: str, prompt_len: int, images: list[tuple[str, int, int]], prompt: list[int] | None = None,
           max_tokens: int = 3):
    req = make_req(req_id, prompt if prompt is not None else prompt_len, max_tokens=max_tokens)
    req.mm_features = [MultiModalFeature("image", ident, offset, length, {}) for ident, offset, length in images]
    return req


class EncoderDriver(Driver):
    """Driver plus a fake worker encoder cache."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(sched)
        self.held: set[str] = set()
        self.encoded: list[tuple[int, str]] = []  # (step, identifier) of every encoder run

    def step(self):
        view = super().step()
        step = len(self.outputs) - 1
        msg = view.message
        for ident in msg.free_encoder_mm_hashes:
            self.held.discard(ident)
        features = {r.req_id: r.state.mm_features for r in view.scheduled}
        for req_id, indices in msg.scheduled_encoder_inputs.items():
            for i in indices:
                ident = features[req_id][i].identifier
                self.encoded.append((step, ident))
                self.held.add(ident)
        for r in view.scheduled:
            end = r.start_pos + len(r.token_ids)
            for f in r.state.mm_features:
                if f.offset < end and f.offset + f.length > r.start_pos:
                    assert f.identifier in self.held, f"step {step}: {r.req_id} computes {f.identifier}'s " \
                                                      "placeholders without its embeddings"
        return view


def test_image_encoded_once_with_the_step_that_reaches_it():
    """Chunks of 5 tokens: the image at 7..23 is encoded in the step covering 5..10, once, and its
    chunks read it until it is computed."""
    sched = make_scheduler(threshold=5)
    d = EncoderDriver(sched)
    sched.add_request(mm_req("a", 30, [("img", 7, 16)]))
    d.run()
    assert d.encoded == [(1, "img")]
    cache = sched.encoder_cache_manager
    assert cache.cached == {"img": set()} and "img" in cache.freeable  # kept for reuse, unreferenced


def test_budget_stops_the_chunk_before_an_image():
    """A budget of 16 embeddings: the second image of a prompt waits for the next step, whose chunk
    starts at its placeholders."""
    sched = make_scheduler(encoder_budget=16)
    d = EncoderDriver(sched)
    sched.add_request(mm_req("a", 40, [("one", 2, 16), ("two", 20, 16)]))
    d.step()
    assert d.scheduled(0) == {"a": 20}  # up to the second image
    d.step()
    assert d.scheduled(1) == {"a": 20}
    assert d.encoded == [(0, "one"), (1, "two")]
    d.run()


def test_a_repeated_image_is_encoded_once():
    sched = make_scheduler()
    d = EncoderDriver(sched)
    sched.add_request(mm_req("a", 20, [("same", 2, 16)]))
    sched.add_request(mm_req("b", 24, [("same", 6, 16)]))
    d.run()
    assert d.encoded == [(0, "same")]
    sched.add_request(mm_req("c", 20, [("same", 1, 16)]))  # later, unreferenced but still held
    d.run()
    assert [ident for _, ident in d.encoded] == ["same"]


def test_eviction_reaches_the_workers():
    """A cache of 16 embeddings holds one image: the next one evicts it, and the step message says so."""
    sched = make_scheduler(encoder_cache=16, encoder_budget=16)
    d = EncoderDriver(sched)
    sched.add_request(mm_req("a", 20, [("first", 2, 16)]))
    d.run()
    sched.add_request(mm_req("b", 20, [("second", 2, 16)]))
    view = d.step()
    assert view.message.free_encoder_mm_hashes == ["first"]
    d.run()
    sched.add_request(mm_req("c", 20, [("first", 2, 16)]))  # evicted: encoded again
    d.run()
    assert [ident for _, ident in d.encoded] == ["first", "second", "first"]


def test_no_room_waits_then_runs():
    """Two requests each with a 16-embedding image and room for one: the second waits until the
    first's image is computed, and both finish."""
    sched = make_scheduler(encoder_cache=16, encoder_budget=16)
    d = EncoderDriver(sched)
    sched.add_request(mm_req("a", 20, [("x", 2, 16)]))
    sched.add_request(mm_req("b", 20, [("y", 2, 16)]))
    d.step()
    assert d.scheduled(0) == {"a": 20, "b": 2}  # b computes up to its image
    d.run()
    assert {ident for _, ident in d.encoded} == {"x", "y"}


def test_preempted_request_gets_its_image_back():
    """A KV cache too small for both requests: the newest is preempted, and when it resumes its
    image is held (or encoded again) before its placeholders are recomputed."""
    sched = make_scheduler(num_blocks=12, encoder_cache=32, encoder_budget=32)
    d = EncoderDriver(sched)
    sched.add_request(mm_req("a", 20, [("x", 2, 16)], max_tokens=12))
    sched.add_request(mm_req("b", 20, [("y", 2, 16)], max_tokens=12))
    d.run()
    assert sched.num_preemptions > 0
    assert set(d.finished) == {"a", "b"}


def test_prefix_hit_inside_an_image():
    """Same tokens, same image: blocks up to the last whole one are hits, which end inside the
    image; the rest of its placeholders read the held embeddings. Another image at the same
    place shares only the blocks before it."""
    sched = make_scheduler()
    d = EncoderDriver(sched)
    prompt = list(range(3000, 3022))
    sched.add_request(mm_req("a", 0, [("x", 2, 16)], prompt=prompt))
    d.run()
    sched.add_request(mm_req("b", 0, [("x", 2, 16)], prompt=prompt))
    d.step()
    assert d.outputs[-1].scheduled[0].start_pos == 20  # 5 blocks of 4 hit; the last token is computed
    sched.add_request(mm_req("c", 0, [("z", 2, 16)], prompt=prompt))
    d.run()
    c_start = [s.start_pos for v in d.outputs for s in v.scheduled if s.req_id == "c"][0]
    assert c_start == 0  # block 0 holds image placeholders (2..17): another image never hits


def test_a_waiting_request_pins_no_image():
    """A request that looks up a cached image and then finds no KV blocks keeps no reference to it:
    a waiting request must not hold cache room a running request may need for its next image."""
    sched = make_scheduler(num_blocks=6, encoder_cache=32, encoder_budget=32)
    d = EncoderDriver(sched)
    sched.add_request(mm_req("a", 20, [("x", 1, 16)], max_tokens=1))
    d.run()  # x is cached, unreferenced
    sched.add_request(mm_req("b", 20, [], max_tokens=3))  # takes 5 of the 6 blocks
    sched.add_request(mm_req("c", 20, [("x", 1, 16)], max_tokens=1))  # finds x, then no blocks
    d.step()
    assert d.scheduled(len(d.outputs) - 1) == {"b": 20}
    assert sched.encoder_cache_manager.cached["x"] == set()
    d.run()
    assert {"a", "b", "c"} <= set(d.finished)


def test_whole_images_end_a_chunk_before_an_image_it_cannot_finish():
    """disable_chunked_mm_input (Gemma 3): chunks of 10 would split the image at 7..23; the first
    stops at 7, the second takes the whole image and more, within the threshold after it."""
    sched = make_scheduler(threshold=10, whole_images=True)
    d = EncoderDriver(sched)
    sched.add_request(mm_req("a", 40, [("img", 7, 16)]))
    d.step()
    assert d.scheduled(0) == {"a": 7}
    d.step()
    assert d.scheduled(1) == {"a": 16}  # past the threshold: the image's rest, all of it
    d.run()
    assert d.encoded == [(1, "img")]


def test_whole_images_after_a_prefix_hit_inside_the_image():
    """A prefix-cache hit that ends inside an image: the next chunk computes all of its rest,
    or waits for a step with room for it."""
    prompt = list(range(100, 140))
    sched = make_scheduler(threshold=4, whole_images=True)
    d = EncoderDriver(sched)
    sched.add_request(mm_req("a", 40, [("img", 10, 20)], prompt=prompt, max_tokens=1))
    d.run()
    other = prompt[:25] + [7] + prompt[26:]  # differs inside the image: the hit ends there
    sched.add_request(mm_req("b", 40, [("img", 10, 20)], prompt=other, max_tokens=1))
    d.step()
    (start, n), = [(r.start_pos, len(r.token_ids)) for r in d.outputs[-1].scheduled]
    assert (start, n) == (24, 6)  # the hit ends inside the image; the chunk finishes it, past the threshold
