"""Split-KV for the unified attention kernel: how many ranges each sequence's keys are cut into,
the partial sums' buffers, and the kernel that merges them.

With one program per sequence, KV head and query block, a decode batch of a few long sequences
runs on a few SMs, each program walking all its keys. Cut into ranges, the keys are walked by
programs of their own, each keeping its running max, sum and unnormalised output; the merge
rescales them to the common max and adds them. The count depends only on the sequence, head and
query-token counts, as the kernel's grid does, so each CUDA-graph bucket captures its own.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm import envs

MAX_SPLITS = 16
_PROGRAMS_PER_SM = 2  # the splits stop once the working programs are this many per SM


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, block_q: int,
                  device: torch.device) -> int:
    """How many ranges each sequence's keys are cut into: a power of two that brings the working
    programs (sequences x KV heads x query blocks) up to _PROGRAMS_PER_SM per SM, at most
    MAX_SPLITS; 1 off CUDA. PAGEDLLM_ATTENTION_KV_SPLITS sets it instead."""
    forced = envs.PAGEDLLM_ATTENTION_KV_SPLITS
    if forced:
        if forced & (forced - 1) or forced > MAX_SPLITS:
            raise ValueError(f"PAGEDLLM_ATTENTION_KV_SPLITS={forced}: a power of two up to {MAX_SPLITS}")
        return forced
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads * -(-max_query_len // block_q)
    want = -(-_PROGRAMS_PER_SM * _sm_count(device.index or 0) // programs)
    return min(MAX_SPLITS, triton.next_power_of_2(want))


def partial_buffers(splits: int, num_tokens: int, num_heads: int, head_dim: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's unnormalised output [splits, T, Hq, D] and its (max, sum) [splits, T, Hq, 2]."""
    part = torch.empty(splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=device)
    return part, torch.empty(splits, num_tokens, num_heads, 2, dtype=torch.float32, device=device)


def merge_splits(part: torch.Tensor, ml: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, Hq, D] from the splits' partial sums."""
    splits, num_tokens, num_heads, head_dim = part.shape
    _merge_splits_kernel[(num_tokens, num_heads)](
        part, ml, out, num_tokens, num_heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), NUM_SPLITS=splits,
    )


@triton.jit
def _merge_splits_kernel(
    part_ptr, ml_ptr, out_ptr, num_tokens, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """One (token, head): the splits' partial softmax sums rescaled to their common max and added."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (tl.arange(0, NUM_SPLITS) * num_tokens + token) * num_heads + head
    m = tl.load(ml_ptr + 2 * part)
    total = tl.max(m, 0)
    weight = tl.exp(m - tl.where(total == float("-inf"), 0.0, total))  # 0 for a split that saw no key
    norm = tl.sum(weight * tl.load(ml_ptr + 2 * part + 1), 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    acc = tl.load(part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(norm == 0.0, 1.0, norm)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
