"""Turns a SchedulerOutput into tensors, runs the forward pass, samples.

The runner knows tensors, never queues: it gets token ids, positions and block
ids per request and returns one sampled token per request that is due.
"""

from __future__ import annotations

import logging

import numpy as np
import psutil
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.forward_context import AttentionMetadata, PrefillSegment, set_forward_context
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.sampler import Sampler, gather_logprobs
from pagedllm.model_executor.loader.model_loader import get_model
from pagedllm.worker.sampling_metadata import SamplingMetadataBuilder

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 4 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device_config.device
        self.block_size = config.cache_config.block_size
        self.model = get_model(config.model_config, self.device)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        seed_gen = torch.Generator(device=self.device)
        seed_gen.manual_seed(config.model_config.seed)
        self.sampler = Sampler(seed_gen)
        vocab = config.model_config.text_config.vocab_size
        self.sampling_metadata = SamplingMetadataBuilder(vocab, self.device)
        self.kv_caches: list[torch.Tensor] = []

    # ---- KV cache ---------------------------------------------------------
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.config.model_config.dtype).element_size()
        return sum(
            2 * self.block_size * a.num_kv_heads * a.head_dim * itemsize for a in self.attn_layers
        )

    def determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override:
            return cache.num_gpu_blocks_override
        budget = cache.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * cache.gpu_memory_utilization)
            else:
                # KV pages are touched only as they fill, but cap the reservation so the
                # engine coexists with the rest of the machine.
                budget = min(_CPU_DEFAULT_KV_BYTES, psutil.virtual_memory().available // 4)
        return max(1, budget // self.bytes_per_block())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        dtype = self.config.model_config.dtype
        self.kv_caches = []
        for layer in self.attn_layers:
            shape = (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            kv = _zeros(shape, dtype, self.device)
            layer.kv_cache = kv
            self.kv_caches.append(kv)

    # ---- one step ---------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.sampling_metadata.drop(sched.finished_req_ids)
        reqs = sched.scheduled
        if not reqs:
            return ModelRunnerOutput([], [])
        bs = self.block_size
        num_reqs = len(reqs)
        query_lens = np.fromiter((len(r.token_ids) for r in reqs), np.int64, num_reqs)
        starts = np.fromiter((r.start_pos for r in reqs), np.int64, num_reqs)
        cu_end = np.cumsum(query_lens)
        cu_start = cu_end - query_lens
        total = int(cu_end[-1])
        req_of_token = np.repeat(np.arange(num_reqs), query_lens)
        positions = np.arange(total) - cu_start[req_of_token] + starts[req_of_token]
        seq_lens = starts + query_lens
        max_blocks = int(-(-seq_lens.max() // bs))
        block_table = np.zeros((num_reqs, max_blocks), np.int64)
        for i, r in enumerate(reqs):
            n = min(len(r.block_ids), max_blocks)
            block_table[i, :n] = r.block_ids[:n]
        slots = block_table[req_of_token, positions // bs] * bs + positions % bs
        input_ids = np.fromiter((t for r in reqs for t in r.token_ids), np.int64, total)

        dev = self.device
        is_decode = (query_lens == 1) & (starts > 0)
        decode_rows = np.nonzero(is_decode)[0]
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            decode_token_idx=None,
            decode_block_tables=None,
            decode_seq_lens=None,
            prefills=[],
        )
        if len(decode_rows):
            d_lens = seq_lens[decode_rows]
            d_blocks = int(-(-d_lens.max() // bs))
            md.decode_token_idx = torch.from_numpy(cu_start[decode_rows]).to(dev)
            md.decode_block_tables = torch.from_numpy(block_table[decode_rows, :d_blocks]).to(dev)
            md.decode_seq_lens = torch.from_numpy(d_lens).to(dev)
        for i in np.nonzero(~is_decode)[0]:
            n_blocks = int(-(-seq_lens[i] // bs))
            md.prefills.append(
                PrefillSegment(
                    token_start=int(cu_start[i]),
                    query_len=int(query_lens[i]),
                    context_len=int(starts[i]),
                    block_table=torch.from_numpy(block_table[i, :n_blocks]).to(dev),
                )
            )

        sample_rows = [i for i, r in enumerate(reqs) if r.sample]
        with set_forward_context(md):
            hidden = self.model(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev))
        out = ModelRunnerOutput([r.req_id for r in reqs], [None] * num_reqs)
        for i, r in enumerate(reqs):
            if r.sampling_params.prompt_logprobs is not None and starts[i] < len(r.prompt_token_ids) - 1:
                out.prompt_logprobs[r.req_id] = self._prompt_logprobs(r, hidden[cu_start[i] : cu_end[i]])
        if sample_rows:
            logits_idx = torch.from_numpy(cu_end[sample_rows] - 1).to(dev)
            logits = self.model.compute_logits(hidden[logits_idx])
            sample_reqs = [reqs[i] for i in sample_rows]
            md = self.sampling_metadata.build(sample_reqs)
            if sched.grammar_bitmask is not None:
                md.grammar_bitmask = _rows_bitmask(sched, sample_reqs)
            result = self.sampler(logits, md)
            for row, tok in zip(sample_rows, result.sampled_token_ids.tolist()):
                out.sampled_token_ids[row] = tok
            if result.logprobs is not None:
                out.logprobs = [None] * num_reqs
                ids, vals = result.logprob_token_ids.tolist(), result.logprobs.tolist()
                ranks = result.sampled_ranks.tolist()
                for k, (row, r) in enumerate(zip(sample_rows, sample_reqs)):
                    n = r.sampling_params.logprobs
                    if n is not None:
                        out.logprobs[row] = (ids[k][: n + 1], vals[k][: n + 1], ranks[k])
        return out

    def _prompt_logprobs(self, r, hidden: torch.Tensor) -> list:
        """Logprobs of the prompt tokens this chunk predicts (position p predicts p + 1)."""
        num_prompt = len(r.prompt_token_ids)
        n = min(len(r.token_ids), num_prompt - 1 - r.start_pos)
        targets = torch.tensor(r.prompt_token_ids[r.start_pos + 1 : r.start_pos + 1 + n], device=hidden.device)
        logprobs = self.model.compute_logits(hidden[:n]).float().log_softmax(dim=-1)
        ids, vals, ranks = gather_logprobs(logprobs, r.sampling_params.prompt_logprobs, targets)
        return list(zip(ids.tolist(), vals.tolist(), ranks.tolist()))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed KV memory. On CPU it comes from calloc via numpy, so the OS hands out
    zero pages lazily: resident memory grows with use, not with the reservation.
    (Zeros, not garbage: masked-out slots still meet V in 0 * x, and NaN * 0 is NaN.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _rows_bitmask(sched: SchedulerOutput, sample_reqs) -> torch.Tensor:
    """The scheduler's grammar bitmask laid out by sample row; rows without a grammar allow all."""
    rows = sched.grammar_rows
    full = torch.full((len(sample_reqs), sched.grammar_bitmask.shape[1]), -1, dtype=torch.int32)
    for k, r in enumerate(sample_reqs):
        row = rows.get(r.req_id)
        if row is not None:
            full[k] = sched.grammar_bitmask[row]
    return full
