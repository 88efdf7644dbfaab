"""The worker's side of images: the encoder cache (identifier → embeddings), the encoder runs the
scheduler asks for, and each step's embeddings at the placeholder positions it computes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.multimodal.processing import from_tensor_data
from pagedllm.worker.input_batch import CachedRequestState, StepRow


class EncoderRunner:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cache: dict[str, torch.Tensor] = {}

    def execute(self, sched: SchedulerOutput, requests: dict[str, CachedRequestState]) -> None:
        """Drop what the scheduler evicted, then encode the images it scheduled, in one batch."""
        for ident in sched.free_encoder_mm_hashes:
            self.cache.pop(ident, None)
        features = []
        for req_id, indices in sched.scheduled_encoder_inputs.items():
            state = requests[req_id]
            features += [state.mm_features[i] for i in indices if state.mm_features[i].identifier not in self.cache]
        if not features:
            return
        items = [{k: torch.from_numpy(from_tensor_data(v).copy()).to(self.device) for k, v in f.data.items()}
                 for f in features]
        outputs = self.model.embed_multimodal(items)
        for f, emb in zip(features, outputs):
            if emb.shape[0] != f.length:
                raise RuntimeError(f"the encoder made {emb.shape[0]} embeddings for an image with {f.length} "
                                   "placeholder tokens")
            self.cache[f.identifier] = emb

    def gather(self, rows: Sequence[StepRow], cu_start: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat positions, embeddings) of the step's tokens that are image placeholders; None
        when the step computes none."""
        dst: list[np.ndarray] = []
        src: list[torch.Tensor] = []
        for k, r in enumerate(rows):
            for f in r.state.mm_features:
                a, b = max(r.start_pos, f.offset), min(r.end, f.offset + f.length)
                if a >= b:
                    continue
                emb = self.cache.get(f.identifier)
                if emb is None:
                    raise RuntimeError(f"request {r.req_id}: image {f.identifier[:12]}'s embeddings are not in "
                                       "the encoder cache")
                dst.append(np.arange(a, b) - r.start_pos + int(cu_start[k]))
                src.append(emb[a - f.offset : b - f.offset])
        if not dst:
            return None
        return torch.from_numpy(np.concatenate(dst)).to(self.device), torch.cat(src)
