"""The LoRA delta of one linear layer, for a whole batch of mixed adapters at once.

Each target layer holds, for each of its sub-matrices (q, k, v of a fused qkv; gate, up), the
A and B of `max_loras` slots of `max_rank` rows, stacked: A_all [S·L·R, in], B_all [S·L·R, out]
(a sub-matrix's B rows write only its slice of the outputs; a smaller rank leaves zero rows).
Per step the runner sets one mask [tokens, L·R] that is 1 where a column belongs to the token's
slot. Then the whole batch's delta is two GEMMs, Punica's shrink and expand:

    delta = ((x @ A_allᵀ) * mask) @ B_all

Base-model tokens have an all-zero mask row; a step without adapter tokens skips both GEMMs.
The delta adds to whatever computed the base output (float, packed, or int8/int4 kernels).
"""

from __future__ import annotations

import torch


class LinearLoRA:
    def __init__(self, in_features: int, out_slices: dict[str, tuple[int, int]], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.subs = list(out_slices)  # sub-matrix names, in stacking order
        self.out_slices = out_slices  # name → (offset, size) in the layer's outputs
        self.max_loras, self.max_rank = max_loras, max_rank
        out_features = sum(size for _, size in out_slices.values())
        rows = len(self.subs) * max_loras * max_rank
        self.lora_a = torch.zeros(rows, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(rows, out_features, dtype=dtype, device=device)

    def _rows(self, sub: str, slot: int) -> slice:
        start = (self.subs.index(sub) * self.max_loras + slot) * self.max_rank
        return slice(start, start + self.max_rank)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's (A [r, in], B·scaling [out_sub, r]) per sub-matrix; others are zeroed."""
        for sub in self.subs:
            rows = self._rows(sub, slot)
            self.lora_a[rows] = 0
            self.lora_b[rows] = 0
            if sub in weights:
                a, b = weights[sub]
                r = a.shape[0]
                offset, size = self.out_slices[sub]
                self.lora_a[rows.start:rows.start + r] = a
                self.lora_b[rows.start:rows.start + r, offset:offset + size] = b.t()

    def apply(self, x: torch.Tensor, out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """out + this layer's delta for every token; x [T, in], out [T, out], mask [T, L·R]."""
        shrink = x.reshape(-1, x.shape[-1]) @ self.lora_a.t()
        shrink = (shrink.view(shrink.shape[0], len(self.subs), -1) * mask[:, None, :]).view(shrink.shape[0], -1)
        return out.reshape(-1, out.shape[-1]).addmm(shrink, self.lora_b).view(out.shape)
