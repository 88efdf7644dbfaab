"""LinearLoRA's batched shrink/expand equals each token's own adapter applied by hand."""

from __future__ import annotations

import torch

from pagedllm.model_executor.layers.lora import LinearLoRA


def test_batched_delta_equals_per_token_adapters():
    torch.manual_seed(0)
    slices = {"q": (0, 12), "k": (12, 4), "v": (16, 4)}
    lora = LinearLoRA(8, slices, max_loras=3, max_rank=6, dtype=torch.float32, device=torch.device("cpu"))
    adapters = {  # slot → sub → (A [r, in], B [out_sub, r]); ranks differ, some subs absent
        0: {"q": (torch.randn(2, 8), torch.randn(12, 2)), "v": (torch.randn(2, 8), torch.randn(4, 2))},
        2: {"k": (torch.randn(6, 8), torch.randn(4, 6))},
    }
    lora.set_slot(1, {"q": (torch.randn(3, 8), torch.randn(12, 3))})  # then overwritten: nothing may remain
    lora.set_slot(1, {})
    for slot, weights in adapters.items():
        lora.set_slot(slot, weights)
    token_slot = torch.tensor([0, -1, 2, 2, 1, 0])
    x, base = torch.randn(6, 8), torch.randn(6, 20)
    mask = (token_slot[:, None] == torch.arange(3 * 6)[None, :] // 6).float()
    got = lora.apply(x, base.clone(), mask)
    want = base.clone()
    for t, slot in enumerate(token_slot.tolist()):
        for sub, (a, b) in adapters.get(slot, {}).items():
            offset, size = slices[sub]
            want[t, offset:offset + size] += b @ (a @ x[t])
    torch.testing.assert_close(got, want)
