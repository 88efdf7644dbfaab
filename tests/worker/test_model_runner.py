"""The model runner on the tiny random-weight llama, driven with hand-made SchedulerOutputs: the
K/V cache size, greedy tokens over chunked prefills and decodes against transformers, prompt
logprobs per chunk, and copying blocks."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

from pagedllm.core.sched_output import NewRequestData, SchedulerOutput
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner, _zeros
from tests.utils import assert_greedy_match, hf_greedy

BS = 8
KV_BYTES = 1 << 22
# tiny_llama: 3 layers, 2 K/V heads of 16, float32: K and V of 8 tokens in every layer.
BYTES_PER_BLOCK = 2 * BS * 3 * 2 * 16 * 4
PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 250, 12, 61, 300], [44, 3, 18, 99, 120, 6]]


@pytest.fixture(scope="module")
def runner(tiny_llama) -> ModelRunner:
    config = EngineArgs(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory=KV_BYTES,
                        block_size=BS).create_engine_config()
    runner = ModelRunner(config)
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


class _Messages:
    """Step messages as the scheduler builds them: a request whole once, then as diffs."""

    def __init__(self) -> None:
        self.synced: dict[str, tuple[int, int]] = {}  # req_id → (tokens, blocks) the runner holds

    def step(self, *reqs) -> SchedulerOutput:
        """Each req: (req_id, prompt, output, start, end, blocks, params): tokens [start, end)
        of prompt + output, sampling when they reach the end."""
        out = SchedulerOutput()
        cached = out.scheduled_cached_reqs
        for req_id, prompt, output, start, end, blocks, params in reqs:
            tokens = prompt + output
            if req_id not in self.synced:
                out.scheduled_new_reqs.append(NewRequestData(req_id, prompt, SamplingParams(
                    temperature=0, max_tokens=16, **params), list(blocks), start, list(output)))
            else:
                num_tokens, num_blocks = self.synced[req_id]
                cached.req_ids.append(req_id)
                cached.new_token_ids.append(tokens[num_tokens:])
                cached.new_block_ids.append(blocks[num_blocks:])
                cached.num_computed_tokens.append(start)
            self.synced[req_id] = (len(tokens), len(blocks))
            out.num_scheduled_tokens[req_id] = end - start
            out.total_num_scheduled_tokens += end - start
        return out


def _step(runner: ModelRunner, sched: SchedulerOutput):
    """One whole step as the worker runs it: the forward pass, then the sampling."""
    runner.forward(sched)
    return runner.sample_tokens(None)


def _req(req_id, prompt, output, start, end, blocks, **params) -> tuple:
    return (req_id, prompt, output, start, end, blocks, params)


def test_kv_cache_size(runner):
    assert runner.bytes_per_block() == BYTES_PER_BLOCK
    num_blocks = runner.determine_num_blocks()
    assert num_blocks == KV_BYTES // BYTES_PER_BLOCK
    assert len(runner.kv_caches) == 3
    assert all(kv.shape == (2, num_blocks, BS, 2, 16) and kv.dtype == torch.float32 for kv in runner.kv_caches)


def test_greedy_tokens_over_chunks_and_decodes_match_transformers(runner, tiny_llama):
    a, b = PROMPTS
    blocks = {"a": [9, 3, 12], "b": [4, 20]}  # scattered, disjoint
    out_a: list[int] = []
    out_b: list[int] = []
    messages = _Messages()

    # Step 1: the first 7 tokens of a (no sample), all of b (samples its first token).
    sched = messages.step(_req("a", a, out_a, 0, 7, blocks["a"]), _req("b", b, out_b, 0, len(b), blocks["b"]))
    result = _step(runner, sched)
    assert result.req_ids == ["a", "b"] and result.sampled_token_ids[0] is None
    out_b += result.sampled_token_ids[1]
    # Step 2: the rest of a's prompt next to b's decode; then decodes of both.
    steps = [(7, len(a), len(b))] + [None] * 5
    for step in steps:
        start_a, end_a, start_b = step or (len(a) + len(out_a) - 1, len(a) + len(out_a), len(b) + len(out_b) - 1)
        sched = messages.step(_req("a", a, out_a, start_a, end_a, blocks["a"]),
                              _req("b", b, out_b, start_b, start_b + 1, blocks["b"]))
        result = _step(runner, sched)
        assert all(len(t) == 1 for t in result.sampled_token_ids)
        out_a += result.sampled_token_ids[0]
        out_b += result.sampled_token_ids[1]
    assert len(out_a) == 6 and len(out_b) == 7
    assert_greedy_match([out_a], hf_greedy(tiny_llama, [a], 6))
    assert_greedy_match([out_b], hf_greedy(tiny_llama, [b], 7))


def test_prompt_logprobs_of_each_chunk_match_transformers(runner, tiny_llama):
    from transformers import AutoModelForCausalLM

    a = PROMPTS[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([a])).logits[0].double(), -1)
    entries = []
    messages = _Messages()
    for start, end in ((0, 7), (7, len(a))):
        sched = messages.step(_req("p", a, [], start, end, [2, 30], prompt_logprobs=1))
        entries += _step(runner, sched).prompt_logprobs["p"]
    # Position p predicts token p + 1: 7 entries from the first chunk, 3 from the second.
    assert len(entries) == len(a) - 1
    for p, (ids, vals, rank) in enumerate(entries):
        lp, actual = ref[p], a[p + 1]
        assert ids[0] == actual and ids[1] == int(lp.argmax())
        assert vals[0] == pytest.approx(float(lp[actual]), abs=1e-4)
        assert vals[1] == pytest.approx(float(lp.max()), abs=1e-4)
        assert rank == int((lp > lp[actual]).sum()) + 1


def test_copy_blocks_copies_every_layer(runner):
    for i, kv in enumerate(runner.kv_caches):
        kv[:, 40] = float(i + 1)
        kv[:, 41] = -1.0
    runner.copy_blocks([(40, 41), (40, 42)])
    for i, kv in enumerate(runner.kv_caches):
        assert (kv[:, 41] == i + 1).all() and (kv[:, 42] == i + 1).all()


def _flags_of(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address`."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, "no mapping holds the address"
    return flags


def _resident_pages(t: torch.Tensor) -> int:
    """How many of the tensor's own pages are in memory, from /proc/self/pagemap (bit 63: present).
    Not the mapping's Rss: the kernel merges a new anonymous mapping with a neighbour of the same
    flags (another KV cache this process holds), whose pages would be counted too."""
    page = mmap.PAGESIZE
    first, last = t.data_ptr() // page, (t.data_ptr() + t.nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                    reason="reads /proc/self/smaps; a Linux kernel with transparent huge pages")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_memory_is_lazy_zeroes_without_huge_pages(dtype):
    """The KV cache is zeroes paged in as blocks are first written, on base pages whatever the
    machine's transparent huge page setting: a huge page is zeroed whole at its first write
    (with compaction where the kernel defragments on demand), a multi-millisecond stall in the
    middle of a decode step."""
    kv = _zeros((2, 1024, 16, 2, 128), dtype, torch.device("cpu"))  # 32 or 16 MiB
    assert kv.shape == (2, 1024, 16, 2, 128) and kv.dtype == dtype
    flags = _flags_of(kv.data_ptr() + kv.nbytes // 2)
    assert "hg" not in flags and "nh" in flags  # advised against transparent huge pages
    assert _resident_pages(kv) == 0  # nothing paged in yet
    kv[1, 700, 3] = 2.5  # 1 KiB or 512 bytes: one base page, not a 2 MiB huge one
    assert _resident_pages(kv) == 1
    assert float(kv.sum()) == 2.5 * 2 * 128
    assert not kv[0].any()
