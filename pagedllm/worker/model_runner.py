"""Turns a SchedulerOutput into tensors, runs the forward pass, samples.

The runner knows tensors, never queues: it gets token ids, positions and block
ids per request and returns the new tokens of each request that is due: one sampled
token, or with speculative decoding the accepted drafts plus one, and the next drafts.
"""

from __future__ import annotations

import inspect
import logging
import mmap
from collections import deque
from dataclasses import replace

import numpy as np
import psutil
import torch

from pagedllm.config import EAGLE_METHODS, EngineConfig
from pagedllm.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed import get_pp_group
from pagedllm.forward_context import exact_logit_rows, set_forward_context
from pagedllm.lora.manager import LoRAManager
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.kv_quant import bytes_per_token_head, groups_per_head, kv_quant_for
from pagedllm.model_executor.layers.pooler import finish_vectors, pool
from pagedllm.model_executor.layers.sampler import Sampler, gather_logprobs
from pagedllm.model_executor.layers.triton_ops import use_triton_attention
from pagedllm.model_executor.loader.model_loader import get_model
from pagedllm.model_executor.models.utils import IntermediateTensors
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.eagle import EagleProposer
from pagedllm.spec_decode.medusa import MedusaProposer
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.rejection_sampler import accept_certain, accept_sampled, target_probs
from pagedllm.transformers_utils.page_cache import anonymous_zeros
from pagedllm.worker.cuda_graph import CUDAGraphRunner, capture_sizes
from pagedllm.worker.decode_plan import DecodePlanRunner
from pagedllm.worker.eagle_plan import Eagle3PlanRunner
from pagedllm.worker.encoder_runner import EncoderRunner
from pagedllm.worker.input_batch import InputBatch, StepRow
from pagedllm.worker.sampling_metadata import SamplingMetadataBuilder
from pagedllm.worker.step_inputs import prepare_inputs

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 4 << 30
WARM_UP_PROMPT_TOKENS = 4  # the warm-up prefill: enough rows for every kernel tile (GGUF and int4 tile by 4)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device_config.device
        self.block_size = config.cache_config.block_size
        self.model = get_model(config.model_config, self.device)
        self.pp = get_pp_group()
        self.pooler_config = config.model_config.pooler_config  # None: the generate runner
        self.takes_token_types = "token_type_ids" in inspect.signature(self.model.forward).parameters
        self.hidden_size = config.model_config.text_config.hidden_size
        self._sending: tuple | None = None  # (work, tensor): the last send to the next stage
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        seed_gen = torch.Generator(device=self.device)
        seed_gen.manual_seed(config.model_config.seed)
        self.sampler = Sampler(seed_gen)
        vocab = config.model_config.text_config.vocab_size
        sched = config.scheduler_config
        num_spec = config.speculative_config.num_speculative_tokens if config.speculative_config else 0
        self.input_batch = InputBatch(sched.max_num_seqs, sched.max_model_len + num_spec,
                                      -(-(sched.max_model_len + num_spec) // self.block_size),
                                      getattr(self.model, "get_mrope_input_positions", None))
        self.sampling_metadata = SamplingMetadataBuilder(vocab, self.device, self.input_batch)
        self.kv_caches: list[torch.Tensor] = []
        # The engine core does not send back the tokens sampled here: each request's state takes them.
        self.async_scheduling = config.scheduler_config.async_scheduling
        # Steps between forward() and sample_tokens(), oldest first (several with pipeline parallel).
        self._pending: deque[tuple] = deque()
        self.cuda_graphs: CUDAGraphRunner | None = None  # set up once the KV cache is bound
        self.lora_manager = None
        if config.lora_config is not None:
            mc = config.model_config
            self.lora_manager = LoRAManager(self.model, config.lora_config, mc.text_config, mc.dtype, self.device)
        # Decode steps on the C kernels replay bound kernel calls (decode_plan.py: the CPU's CUDA graphs).
        self.decode_plans: DecodePlanRunner | None = None
        if (self.device.type == "cpu" and self.lora_manager is None and self.pp.world_size == 1
                and self.pooler_config is None):
            get_lm = getattr(self.model, "get_language_model", None)  # a vision-language model's decoder
            self.decode_plans = DecodePlanRunner(get_lm() if get_lm is not None else self.model)
        # A vision-language model: its image encoder runs here, on the first pipeline stage.
        self.encoder = EncoderRunner(self.model, self.device) if getattr(self.model, "supports_multimodal",
                                                                         False) else None
        self.mm_prefix_lm = config.model_config.is_mm_prefix_lm  # image tokens attend both ways (Gemma 3)
        spec = config.speculative_config
        self.ngram = self.drafter = self.medusa = self.eagle = None
        if spec is not None and spec.method == "ngram":
            self.ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec is not None and spec.method == "medusa":
            self.medusa = MedusaProposer(spec.heads_path, spec.medusa_config, spec.num_speculative_tokens,
                                         config.model_config.dtype, self.device)
        elif spec is not None and spec.method in EAGLE_METHODS:
            self.eagle = EagleProposer(config, self.model, self.device, prepare_inputs)
            if self.decode_plans is not None and spec.method == "eagle3":
                self.eagle.layer_plan = Eagle3PlanRunner(self.eagle.head)
        elif spec is not None:
            self.drafter = DraftModelProposer(config, self.device, seed_gen, prepare_inputs)

    # ---- KV cache ---------------------------------------------------------
    def _kv_layers(self) -> list[Attention]:
        """The target's attention layers, then the draft model's or EAGLE head's (same blocks, own tensors)."""
        kv_drafter = self.drafter or self.eagle
        return self.attn_layers + (kv_drafter.attn_layers if kv_drafter is not None else [])

    def bytes_per_block(self, cache_dtype: str | None = None) -> int:
        """Bytes of one block in every layer, at the configured KV cache dtype (or `cache_dtype`)."""
        quant = kv_quant_for(cache_dtype or self.config.cache_config.cache_dtype)
        itemsize = self.config.model_config.dtype.itemsize
        return sum(2 * self.block_size * a.num_kv_heads * bytes_per_token_head(a.head_dim, itemsize, quant)
                   for a in self._kv_layers())

    def determine_available_memory(self) -> int:
        """Bytes this rank gives its KV cache (num_gpu_blocks_override: exactly that many blocks)."""
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override:
            return cache.num_gpu_blocks_override * self.bytes_per_block()
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        if self.device.type == "cuda":
            return self._profile_cuda_memory(cache.gpu_memory_utilization)
        # KV pages are touched only as they fill, but cap the reservation so the engine
        # coexists with the rest of the machine.
        return min(_CPU_DEFAULT_KV_BYTES, psutil.virtual_memory().available // 4)

    @torch.inference_mode()
    def _profile_cuda_memory(self, utilization: float) -> int:
        """vLLM's rule: the KV cache gets `utilization` of the GPU's memory, less the peak of a
        forward pass over a full token budget (weights included) and what is held outside torch
        (the CUDA context, cuBLAS, NCCL)."""
        sched = self.config.scheduler_config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        budget = max(1, sched.max_num_batched_tokens)
        per_seq = max(1, min(budget, sched.max_model_len))
        lens = [per_seq] * (budget // per_seq) + ([budget % per_seq] if budget % per_seq else [])
        step = prepare_inputs([[0] * n for n in lens], [0] * len(lens), [[0]] * len(lens), self.block_size,
                              self.device)
        hidden = self._run_model(step)
        if hidden is not None and self.pooler_config is None:
            # The sampler's worst case, a row a sequence: float32 logits, top-p's sorted copy and its softmax.
            rows = min(sched.max_num_seqs, hidden.shape[0])
            logits = self.model.compute_logits(hidden[:rows]).float()
            values, _ = logits.sort(dim=-1)
            values.softmax(-1).cumsum(-1)
            del logits, values
        self._wait_sent()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        available = int(total * utilization) - peak - outside_torch
        logger.info("GPU memory: %.2f GiB in all, peak %.2f GiB in a forward pass of %d tokens, %.2f GiB outside "
                    "torch: %.2f GiB for the KV cache (gpu_memory_utilization %.2f)", total / 2**30, peak / 2**30,
                    budget, outside_torch / 2**30, max(0, available) / 2**30, utilization)
        if available <= 0:
            raise ValueError(f"no GPU memory is left for the KV cache at gpu_memory_utilization={utilization}: "
                             "raise it, or lower max_num_batched_tokens / max_model_len")
        return available

    def determine_num_blocks(self) -> int:
        per_block = self.bytes_per_block()
        if per_block == 0:  # an encoder keeps no K/V: blocks are only the scheduler's bookkeeping
            sched = self.config.scheduler_config
            return sched.max_num_seqs * -(-sched.max_model_len // self.block_size)
        return max(1, self.determine_available_memory() // per_block)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        dtype = self.config.model_config.dtype
        quant = kv_quant_for(self.config.cache_config.cache_dtype)
        self.kv_caches = []  # every tensor indexed [2, block, ...]: copy_blocks and warm_up treat them alike
        for layer in self._kv_layers():
            shape = (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.kv_cache = _zeros(shape, dtype if quant is None else torch.uint8, self.device)
            layer.kv_quant = quant
            self.kv_caches.append(layer.kv_cache)
            if quant is not None:
                layer.kv_scales = _zeros((*shape[:-1], groups_per_head(layer.head_dim)), torch.float32, self.device)
                self.kv_caches.append(layer.kv_scales)
        if quant is not None and self.kv_caches:
            ratio = self.bytes_per_block("auto") / self.bytes_per_block()
            logger.info("KV cache dtype %s (one byte an element, a float32 scale per 32): %.2fx "
                        "the blocks the model's %s would give in the same memory", quant.name, ratio,
                        str(dtype).removeprefix("torch."))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One short prefill and one decode pass, with logits, in block 0, before any request:
        the first request does not pay for first-call work (the C kernels' build and load,
        oneDNN's primitive creation, allocator growth). Block 0 is zeroed again afterwards. The
        prefill takes WARM_UP_PROMPT_TOKENS (the multi-row kernel paths) and no more: a token of a
        12B model is ~0.3 s of compute on 2 cores."""
        sched = self.config.scheduler_config
        n = max(1, min(WARM_UP_PROMPT_TOKENS, self.block_size - 1, sched.max_model_len - 1,
                       sched.max_num_batched_tokens))
        passes = [([0] * n, 0)]
        if n + 1 <= sched.max_model_len and self.pooler_config is None:  # a pooling model never decodes
            passes.append(([0], n))
        for tokens, start in passes:
            step = prepare_inputs([tokens], [start], [[0]], self.block_size, self.device)
            hidden = self._run_model(step)
            if hidden is not None and self.pooler_config is None:
                self.model.compute_logits(hidden[-1:])
        self._wait_sent()
        for kv in self.kv_caches:
            kv[:, 0].zero_()
        self._set_up_cuda_graphs()

    def _set_up_cuda_graphs(self) -> None:
        """Decode steps replay CUDA graphs where the Triton kernels run (on CPU, under the
        interpreter, the same padded buffers run eagerly), unless enforce_eager; not for a pooling
        model, LoRA adapters, mixtures of experts or pipeline stages."""
        mc = self.config.model_config
        if (mc.enforce_eager or not use_triton_attention(self.device) or self.pooler_config is not None
                or self.lora_manager is not None or self.pp.world_size > 1 or not self.kv_caches
                or (self.eagle is not None and self.eagle.trunk is not None)  # EAGLE-3 reads layers' inputs
                or any(isinstance(m, FusedMoE) for m in self.model.modules())):  # its routing counts on the host
            return
        sched = self.config.scheduler_config
        runner = CUDAGraphRunner(self.model, capture_sizes(sched.max_num_seqs),
                                 -(-sched.max_model_len // self.block_size), self.device)
        try:
            runner.capture_all()
        except Exception:  # the model does something a graph cannot hold: decode eagerly
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            return
        self.cuda_graphs = runner

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """K/V of block src into block dst, in every layer (the draft model's too)."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for kv in self.kv_caches:
            kv[:, dst] = kv[:, src]

    # ---- one step ---------------------------------------------------------
    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput) -> None:
        """The step's forward pass (and its prompt logprobs); `sample_tokens` ends the step."""
        self.sampling_metadata.drop(sched.finished_req_ids)
        kv_drafter = self.drafter or self.eagle
        if kv_drafter is not None:
            kv_drafter.drop(sched.finished_req_ids)
        reqs = self.input_batch.update_states(sched)
        if self.encoder is not None and self.pp.is_first_rank:
            self.encoder.execute(sched, self.input_batch.requests)
        out = ModelRunnerOutput([r.req_id for r in reqs], [None] * len(reqs))
        if not reqs:
            self._pending.append((reqs, None, None, out, None))
            return
        if sched.block_copies:
            self.copy_blocks(sched.block_copies)
        step = self.input_batch.prepare_inputs(reqs, self.block_size, self.device, self.mm_prefix_lm)
        if self.takes_token_types and any(r.token_type_ids is not None for r in reqs):  # a cross-encoder's pairs
            step.token_type_ids = torch.tensor(
                [t for r in reqs for t in (r.token_type_ids or [0] * r.num_tokens)[r.start_pos : r.start_pos
                                                                                   + r.num_scheduled]],
                device=self.device)
        lora_mask = None
        if self.lora_manager is not None:
            lora_mask = self.lora_manager.prepare([r.lora_request for r in reqs], step.query_lens.tolist())
        inputs_embeds = None
        if self.encoder is not None and self.pp.is_first_rank:
            merged = self.encoder.gather(reqs, step.cu_start)
            if merged is not None:  # image placeholders among this step's tokens: their embeddings replace them
                inputs_embeds = self.model.embed_input_ids(step.input_ids, step.positions)
                inputs_embeds[merged[0]] = merged[1].to(inputs_embeds.dtype)
        hidden = self._run_model(step, lora_mask, inputs_embeds)
        if hidden is not None and self.pooler_config is not None:
            self._pool(reqs, hidden, step, out)
        elif hidden is not None:
            for i, r in enumerate(reqs):
                if r.sampling_params.prompt_logprobs is not None and r.start_pos < len(r.prompt_token_ids) - 1:
                    out.prompt_logprobs[r.req_id] = self._prompt_logprobs(r, hidden[step.cu_start[i] : step.cu_end[i]])
        feats = self.eagle.features(hidden) if self.eagle is not None and hidden is not None else hidden
        self._pending.append((reqs, hidden, step.cu_end, out, feats))

    def _pool(self, reqs: list[StepRow], hidden: torch.Tensor, step, out: ModelRunnerOutput) -> None:
        """The vectors of the pooling requests whose prompt this step completed."""
        done = [i for i, r in enumerate(reqs) if r.sample]
        if not done:
            return
        pooled = pool(hidden, step.cu_start[done], step.cu_end[done], self.pooler_config.pooling_type)
        classify = getattr(self.model, "classify", None) if self.config.model_config.classify else None
        out.pooler_output = [None] * len(reqs)
        if classify is not None:  # a classifier: class probabilities (one label: a sigmoid score)
            logits = classify(pooled)
            probs = logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)
            for i, row in zip(done, probs.tolist()):
                out.pooler_output[i] = row
            return
        params = [reqs[i].pooling_params for i in done]
        default = self.pooler_config.normalize
        # An embedding takes the model's normalization by default; `encode` the raw pooled state.
        vectors = finish_vectors(pooled, [(default and p.task == "embed") if p.normalize is None else p.normalize
                                          for p in params],
                                 [p.dimensions for p in params])
        for i, vector in zip(done, vectors):
            out.pooler_output[i] = vector

    def _run_model(self, step, lora_mask: torch.Tensor | None = None,
                   inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """The forward pass of this rank's layers: the hidden states of the previous pipeline stage
        come in, this stage's go out to the next one (without waiting); the last stage returns them."""
        intermediate = None
        if not self.pp.is_first_rank:
            shape = (len(step.input_ids), self.hidden_size)
            intermediate = IntermediateTensors(self.pp.recv_prev(shape, self.config.model_config.dtype, self.device))
        extra = {"token_type_ids": step.token_type_ids} if step.token_type_ids is not None else {}
        if inputs_embeds is not None:
            extra["inputs_embeds"] = inputs_embeds
        graph_size = None
        if self.cuda_graphs is not None and intermediate is None and not extra and lora_mask is None:
            graph_size = self.cuda_graphs.bucket(step.attn_metadata, len(step.input_ids))
        plan = None
        if self.decode_plans is not None and intermediate is None and not extra and lora_mask is None:
            plan = self.decode_plans.plan_for(len(step.input_ids), step.attn_metadata)
        if graph_size is not None:
            hidden = self.cuda_graphs.run(graph_size, step.input_ids, step.positions, step.attn_metadata)
        elif plan is not None:
            hidden = plan.run(step.input_ids, step.positions, step.attn_metadata)
        else:
            with set_forward_context(step.attn_metadata, lora_mask):
                hidden = self.model(step.input_ids, step.positions, intermediate, **extra)
        if self.pp.is_last_rank:
            return hidden
        self._wait_sent()
        self._sending = (self.pp.isend_next(hidden.hidden_states), hidden.hidden_states)
        return None

    def _wait_sent(self) -> None:
        if self._sending is not None:
            self._sending[0].wait()
            self._sending = None

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the step `forward` ran, under the grammar bitmask, and propose the next drafts."""
        reqs, hidden, cu_end, out, feats = self._pending.popleft()
        if hidden is None or self.pooler_config is not None:
            return out  # nothing ran, a pipeline stage before the last, or pooled in forward()
        sample_idx = [i for i, r in enumerate(reqs) if r.sample]
        if sample_idx:
            self._sample(reqs, sample_idx, hidden, cu_end, out, grammar_output)
            if self.async_scheduling:  # the next step, already scheduled, computes these tokens
                self.input_batch.append_tokens([(reqs[i].state, out.sampled_token_ids[i]) for i in sample_idx])
        spec = self.config.speculative_config
        drafting = spec is not None and (spec.disable_by_batch_size is None or len(reqs) < spec.disable_by_batch_size)
        if not drafting:  # a drafter with KV layers still catches up on this step's tokens, for later drafts
            if self.drafter is not None and reqs:
                self.drafter.propose(reqs, out.sampled_token_ids, self.sampling_metadata, max_drafts=0)
            elif self.eagle is not None and reqs:
                self.eagle.propose(reqs, out.sampled_token_ids, feats, cu_end, max_drafts=0)
        elif self.ngram is not None:  # each request's tokens from its batch row, then the new ones
            tokens = self.input_batch.token_ids
            out.spec_token_ids = [
                self.ngram.propose(np.concatenate((tokens[r.row, : r.num_tokens], new))) if new is not None else None
                for r, new in zip(reqs, out.sampled_token_ids)
            ]
        elif self.drafter is not None and reqs:
            out.spec_token_ids = self.drafter.propose(reqs, out.sampled_token_ids, self.sampling_metadata)
        elif self.medusa is not None:
            out.spec_token_ids = self._medusa_drafts(reqs, hidden, cu_end, out.sampled_token_ids)
        elif self.eagle is not None and reqs:
            out.spec_token_ids = self.eagle.propose(reqs, out.sampled_token_ids, feats, cu_end)
        return out

    def _medusa_drafts(self, reqs: list[StepRow], hidden: torch.Tensor, cu_end: np.ndarray,
                       sampled: list[list[int] | None]) -> list[list[int] | None]:
        """Drafts from the hidden row each sampling request's last token came from: its last
        row, or after a verification the row of its last accepted draft."""
        due = [i for i, new in enumerate(sampled) if new is not None]
        rows = [int(cu_end[i]) - 1 - len(reqs[i].spec_token_ids) + len(sampled[i]) - 1 for i in due]
        drafts: list[list[int] | None] = [None] * len(reqs)
        for i, proposal in zip(due, self.medusa.propose(hidden, rows)):
            drafts[i] = proposal
        return drafts

    def _sample(self, reqs: list[StepRow], sample_idx: list[int], hidden: torch.Tensor,
                cu_end: np.ndarray, out: ModelRunnerOutput, grammar_output: GrammarOutput | None) -> None:
        """One row per position to sample: the last token, and every draft being verified
        (row j sees the drafts before it as its history, for penalties and masks)."""
        num_rows = [1 + len(reqs[i].spec_token_ids) for i in sample_idx]
        if max(num_rows) == 1:
            logits_idx = cu_end[sample_idx] - 1
            rows = [reqs[i] for i in sample_idx]
        else:
            logits_idx = np.concatenate([np.arange(cu_end[i] - n, cu_end[i]) for i, n in zip(sample_idx, num_rows)])
            rows = []
            for i, n in zip(sample_idx, num_rows):
                r, p = reqs[i], reqs[i].sampling_params
                if p.needs_output_history or p.min_tokens or p.bad_words_token_ids:
                    rows += [replace(r, output_token_ids=r.output_token_ids + r.spec_token_ids[:j]) for j in range(n)]
                else:  # nothing reads the history: no copies of it per draft row
                    rows += [r] * n
        wants = [j for j, r in enumerate(rows) if r.sampling_params.logprobs is not None]
        with exact_logit_rows(torch.tensor(wants, device=self.device) if wants else None):
            logits = self.model.compute_logits(hidden[torch.from_numpy(logits_idx).to(self.device)])
        md = self.sampling_metadata.build(rows)
        if grammar_output is not None:
            md.grammar_bitmask, md.grammar_rows = _grammar_rows(grammar_output, [reqs[i] for i in sample_idx], num_rows)
        logits, raw_logprobs = self.sampler.apply_constraints(logits, md)
        sampled = self.sampler.sample(logits, md).tolist()
        row = 0
        for i, n in zip(sample_idx, num_rows):
            r = reqs[i]
            q = self.drafter.draft_probs.get(r.req_id) if self.drafter is not None and n > 1 else None
            if n == 1:
                out.sampled_token_ids[i] = sampled[row : row + 1]
            elif q is None or r.sampling_params.greedy:
                out.sampled_token_ids[i] = accept_certain(r.spec_token_ids, sampled[row : row + n])
            else:
                rows_t = torch.arange(row, row + n, device=logits.device)
                p = target_probs(logits[rows_t], md, rows_t)
                gen = md.generators.get(row, self.sampler.generator)
                out.sampled_token_ids[i] = accept_sampled(r.spec_token_ids, sampled[row : row + n], p, q, gen)
            row += n
        if raw_logprobs is not None:
            out.logprobs = self._sample_logprobs(reqs, sample_idx, num_rows, raw_logprobs, md.max_num_logprobs, out)

    @staticmethod
    def _sample_logprobs(reqs, sample_idx: list[int], num_rows: list[int], raw_logprobs: torch.Tensor, k: int,
                         out: ModelRunnerOutput) -> list:
        """Target-model logprobs of each new token (at its own row), for requests that asked."""
        sel_rows: list[int] = []
        sel_tokens: list[int] = []
        row = 0
        for i, n in zip(sample_idx, num_rows):
            tokens = out.sampled_token_ids[i]
            sel_rows += range(row, row + len(tokens))
            sel_tokens += tokens
            row += n
        dev = raw_logprobs.device
        ids, vals, ranks = gather_logprobs(raw_logprobs[torch.tensor(sel_rows, device=dev)], k,
                                           torch.tensor(sel_tokens, device=dev))
        ids, vals, ranks = ids.tolist(), vals.tolist(), ranks.tolist()
        logprobs: list = [None] * len(reqs)
        pos = 0
        for i in sample_idx:
            count = len(out.sampled_token_ids[i])
            n = reqs[i].sampling_params.logprobs
            if n is not None:
                logprobs[i] = [(ids[e][: n + 1], vals[e][: n + 1], ranks[e]) for e in range(pos, pos + count)]
            pos += count
        return logprobs

    def _prompt_logprobs(self, r, hidden: torch.Tensor) -> list:
        """Logprobs of the prompt tokens this chunk predicts (position p predicts p + 1)."""
        num_prompt = len(r.prompt_token_ids)
        n = min(r.num_scheduled, num_prompt - 1 - r.start_pos)
        targets = torch.tensor(r.prompt_token_ids[r.start_pos + 1 : r.start_pos + 1 + n], device=hidden.device)
        with exact_logit_rows(torch.arange(n, device=hidden.device)):
            logprobs = self.model.compute_logits(hidden[:n]).float().log_softmax(dim=-1)
        ids, vals, ranks = gather_logprobs(logprobs, r.sampling_params.prompt_logprobs, targets)
        return list(zip(ids.tolist(), vals.tolist(), ranks.tolist()))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed KV memory. On CPU an anonymous mapping on base pages (`anonymous_zeros`): zero
    pages handed out lazily, 4 KiB at a time, as blocks are first written. (Zeros, not garbage:
    masked-out slots still meet V in 0 * x, and NaN * 0 is NaN.)"""
    if device.type != "cpu" or not int(np.prod(shape)) or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return anonymous_zeros(shape, dtype, huge_pages=False)


def _grammar_rows(grammar_output: GrammarOutput, sample_reqs, num_rows: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The bitmask rows in sample-row order, and the sample rows they mask (a request verifying
    drafts has consecutive rows; rows of requests without a grammar are left out)."""
    first = grammar_output.structured_output_request_ids
    src: list[int] = []
    dst: list[int] = []
    row = 0
    for r, n in zip(sample_reqs, num_rows):
        start = first.get(r.req_id)
        if start is not None:
            src += range(start, start + n)
            dst += range(row, row + n)
        row += n
    bitmask = grammar_output.grammar_bitmask
    return (bitmask if src == list(range(bitmask.shape[0])) else bitmask[src]), dst
