"""Which images' encoder outputs the workers hold, counted in embeddings (vLLM's encoder cache).

An image's embeddings are made once, in the step whose tokens first reach its placeholders, and
kept while a request still has placeholders of it to compute (a chunked prefill splitting the
image reads them again). Entries no request references stay until their room is needed, so an
image repeated across requests is encoded once; the identifiers evicted go to the workers with the
next step (`take_freed`), which drop their tensors before running that step's encoders."""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.core.request import Request


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size  # held by no entry
        self.num_freeable_slots = cache_size  # free, or held by entries no request references
        self.cached: dict[str, set[str]] = {}  # identifier → ids of the requests that reference it
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced entries, oldest first
        self.freed: list[str] = []  # evicted since the last step message

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Whether the workers hold this image's embeddings; if so the request now references them."""
        ident = request.mm_features[input_id].identifier
        refs = self.cached.get(ident)
        if refs is None:
            return False
        if not refs:
            self.num_freeable_slots -= self.freeable.pop(ident)
        refs.add(request.request_id)
        return True

    def can_allocate(self, request: Request, input_id: int, budget: int, num_embeds_pending: int) -> bool:
        """Whether the image fits this step's encoder budget and the cache (beside the
        `num_embeds_pending` this request already asked for this step), evicting unreferenced
        entries, oldest first, to make room."""
        num_embeds = request.mm_features[input_id].length
        if num_embeds > budget:
            return False
        needed = num_embeds + num_embeds_pending
        if needed <= self.num_free_slots:
            return True
        if needed > self.num_freeable_slots:
            return False
        while needed > self.num_free_slots:
            ident, n = self.freeable.popitem(last=False)
            del self.cached[ident]
            self.freed.append(ident)
            self.num_free_slots += n
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        feature = request.mm_features[input_id]
        self.cached.setdefault(feature.identifier, set()).add(request.request_id)
        self.num_free_slots -= feature.length
        self.num_freeable_slots -= feature.length

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        feature = request.mm_features[input_id]
        refs = self.cached.get(feature.identifier)
        if not refs or request.request_id not in refs:
            return
        refs.discard(request.request_id)
        if not refs:
            self.freeable[feature.identifier] = feature.length
            self.num_freeable_slots += feature.length

    def free(self, request: Request) -> None:
        """The request ended or was preempted: it references none of its images any more."""
        for i in range(len(request.mm_features)):
            self.free_encoder_input(request, i)

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed
