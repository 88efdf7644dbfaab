"""Triton kernels for the accelerator path: KV write by slot, unified paged attention over block
tables, the grammar bitmask. They run where the device is CUDA; on CPU only under Triton's
interpreter (`TRITON_INTERPRET=1`) with `PAGEDLLM_ATTENTION_BACKEND=triton`, which is how the test
suite checks them without a GPU. `triton` is imported only by the modules beside this one, so a
CPU install needs no Triton."""

from __future__ import annotations

import torch

from pagedllm import envs


def use_triton_attention(device: torch.device) -> bool:
    """Whether a forward pass on `device` reads its K/V through the Triton kernels: always on
    CUDA; on CPU when PAGEDLLM_ATTENTION_BACKEND=triton (with TRITON_INTERPRET=1)."""
    return device.type == "cuda" or envs.PAGEDLLM_ATTENTION_BACKEND == "triton"
