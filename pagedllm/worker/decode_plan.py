"""A decode step of up to `MAX_PLAN_ROWS` sequences replayed as a fixed list of C kernel calls:
the CPU analogue of CUDA graphs. A decode's forward is ~250 small kernel calls whose Python
around them (module dispatch, shape checks, output allocation, pointer lookups) costs ~10 ms a
step, more than the kernels themselves at batch 1; a plan binds each call's arguments once
(fixed buffers, raw pointers), so a step only writes its tokens' positions, slots, block tables
and lengths into the input buffers and runs the calls. There is one plan per number of rows,
built on the first step of that row count it takes, all on one set of buffers. Besides decodes,
a step may carry prompt chunks of up to KERNEL_CHUNK_ROWS tokens after cached context: the
module path's attention runs their rows as decodes too. The kernels, their
arguments and their order are those of the module path, so its results are bit-identical to it
(tests/worker/test_decode_plan.py).

The model runner sets the plans up and runs them, for any decoder whose trunk embeds and whose
layers compute as one of the recipes here: Gemma 3's sandwich layers (four norms, q/k norm) and
the pre-norm Llama layers (Llama, Mistral, Qwen2 with its q/k/v bias, Qwen3 with its q/k norm).
A recipe is keyed by the `forward` it replays, so a subclass that computes otherwise (Granite's
residual multiplier) keeps the module path. Only on the C kernel path: one rank, weight-only
quantized decoder linears in pagedllm's layout or GGUF blocks (a plan takes no more rows than
their kernels: `linear_max_rows`), no LoRA, float32 or bf16 (the KV cache in that dtype, or
quantized). Anything else keeps the module path. worker/eagle_plan.py builds an EAGLE-3 head's
layer from the same building blocks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from pagedllm import envs
from pagedllm.forward_context import AttentionMetadata
from pagedllm.model_executor.layers import cpu_kernels, gguf_ops
from pagedllm.model_executor.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.model_executor.layers.attention import chunk_runs_as_decodes
from pagedllm.model_executor.layers.gguf_linear import scale_rows
from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from pagedllm.model_executor.models.blocks import GatedMLP
from pagedllm.model_executor.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3Model
from pagedllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer
from pagedllm.model_executor.models.utils import DecoderForCausalLM, DecoderStack

logger = logging.getLogger(__name__)

_ACT_IDS = {SiluAndMul: cpu_kernels.ACTIVATIONS["silu"], GeluTanhAndMul: cpu_kernels.ACTIVATIONS["gelu_tanh"]}


# Most rows a plan runs: above this the module path's Python is a few percent of the step.
MAX_PLAN_ROWS = 64


class Unsupported(Exception):
    """The model, its weights or this step cannot run the plan; the module path runs."""


class PlanBuffers:
    """Inputs and activations for `rows` rows, shared by every plan of a model (each binds the
    first rows it runs) and by its layers, which run one after the other."""

    def __init__(self, attn_mod: torch.nn.Module, mlp: torch.nn.Module, hidden_size: int, rows: int,
                 dtype: torch.dtype, aux_width: int = 0) -> None:
        """Sized by one layer's attention and feed-forward block (every layer of a plan has their
        shapes); `aux_width`: the kept layers' inputs side by side."""
        hq, hk, d = attn_mod.num_heads, attn_mod.num_kv_heads, attn_mod.head_dim
        block_size = attn_mod.attn.kv_cache.shape[2]
        max_blocks = math.ceil(attn_mod.rotary_emb.cos_cache.shape[0] / block_size) + 1
        zeros = partial(torch.zeros, dtype=dtype)
        self.positions = torch.zeros(rows, dtype=torch.int64)
        self.slot = torch.zeros(rows, dtype=torch.int64)
        self.seq_len = torch.zeros(rows, dtype=torch.int64)
        self.block_table = torch.zeros(rows, max_blocks, dtype=torch.int64)
        self.hidden, self.normed, self.proj = (zeros(rows, hidden_size) for _ in range(3))
        self.qkv = zeros(rows, (hq + 2 * hk) * d)
        self.q, self.k, self.o = zeros(rows, hq, d), zeros(rows, hk, d), zeros(rows, hq, d)
        inter = mlp.down_proj.in_features
        self.gate_up, self.act = zeros(rows, 2 * inter), zeros(rows, inter)
        self.aux = zeros(rows, aux_width)

    @classmethod
    def of_trunk(cls, trunk: DecoderStack, rows: int, dtype: torch.dtype) -> PlanBuffers:
        layer = trunk.stage_layers[0]
        hidden_size = getattr(trunk, trunk.embed_name).weight.shape[-1]
        return cls(layer.self_attn, layer.mlp, hidden_size, rows, dtype,
                   len(trunk.aux_hidden_layers) * hidden_size)


def _embed_scale(trunk: DecoderStack, dtype: torch.dtype) -> torch.Tensor | None:
    """What the trunk's `embed` multiplies the looked-up rows by (rounded to the activations'
    dtype first, as Gemma's reference does); None: nothing."""
    embed = type(trunk).embed
    if embed is DecoderStack.embed:
        return None
    if embed is Gemma3Model.embed:
        return torch.tensor(trunk.embed_scale, dtype=dtype)
    raise Unsupported(f"the embedding of {type(trunk).__name__}")


class DecodePlan:
    """Bound kernel calls for `rows` decode tokens through a decoder stack (the embedding, each
    layer by its recipe, the final norm), on the first `rows` rows of `buffers`."""

    def __init__(self, trunk: DecoderStack, rows: int, buffers: PlanBuffers) -> None:
        layers = list(trunk.stage_layers)
        self._bind_buffers(rows, buffers)
        self.embed = getattr(trunk, trunk.embed_name)
        self.embed_scale = _embed_scale(trunk, self.dtype)
        self.trunk, aux = trunk, trunk.aux_hidden_layers
        self.aux = buffers.aux[:rows]
        width = self.hidden.shape[1]
        for i, layer in enumerate(layers):
            if i in aux:  # DecoderStack.forward's `aux_hidden_states`: this layer's input, copied aside
                j = aux.index(i)
                self.calls.append(partial(self.aux[:, j * width : (j + 1) * width].copy_, self.hidden))
            _recipe(layer)(self, layer)
        self._rms(getattr(trunk, trunk.norm_name), self.hidden, self.normed)

    def _bind_buffers(self, rows: int, buffers: PlanBuffers) -> None:
        """The first `rows` rows of `buffers` as this plan's inputs and activations; no calls yet."""
        self.rows, self.dtype, self.nthreads = rows, buffers.hidden.dtype, torch.get_num_threads()
        self.buffers = buffers  # the calls point into it
        # per-step inputs, written in place
        self.positions, self.slot = buffers.positions[:rows], buffers.slot[:rows]
        self.seq_len, self.block_table = buffers.seq_len[:rows], buffers.block_table[:rows]
        self._seq_len_np, self._table_np = self.seq_len.numpy(), self.block_table.numpy()
        self._positions_np, self._slot_np = self.positions.numpy(), self.slot.numpy()
        self.hidden, self.normed = buffers.hidden[:rows], buffers.normed[:rows]
        self.calls: list[Callable[[], object]] = []

    # -- building --

    @staticmethod
    def _dense(t: torch.Tensor) -> torch.Tensor:
        """A model tensor a bound call will point into: the kernels read it as dense."""
        if not t.is_contiguous():
            raise Unsupported("a non-contiguous operand")
        return t

    def _rms(self, norm: torch.nn.Module, x: torch.Tensor, out: torch.Tensor, residual: bool = False) -> None:
        """out = norm(x) (+ out, in place, with `residual`: the kernel reads each residual vector
        before writing it)."""
        w = norm.kernel_weight(x) if type(norm) in (GemmaRMSNorm, RMSNorm) else None
        if w is None:
            raise Unsupported(f"norm {type(norm).__name__}")
        w = self._dense(w)
        self.calls.append(cpu_kernels.bind_rms_norm(x, w, norm.eps, norm.gemma_style, out if residual else None, out,
                                                    self.nthreads))

    def _linear(self, linear: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        if getattr(linear, "tp_size", 1) != 1 or linear.lora is not None:
            raise Unsupported("tensor parallel or LoRA")
        bias = None if linear.bias is None else linear.bias.detach().to(self.dtype).contiguous()
        if linear.gguf is not None and linear.gguf.input_perm is not None:
            raise Unsupported("an act-order weight (its inputs gathered into group order)")
        if linear.gguf is not None:  # one call per segment, each into its columns of `out`
            for seg in linear.gguf.segments:
                if not seg.quantized:
                    raise Unsupported("a float GGUF segment")
                cols = slice(seg.offset, seg.offset + seg.rows)
                seg_bias = None if bias is None else bias[cols].contiguous()
                scaled = seg.out_scale is not None
                self.calls.append(gguf_ops.bind_gguf_linear(
                    x, seg.qtype, seg.weight, linear.in_features, None if scaled else seg_bias, out[:, cols],
                    self.nthreads, repacked=seg.repacked))
                if scaled:
                    self.calls.append(partial(scale_rows, out[:, cols], seg.out_scale, seg_bias))
            return
        quant = linear.quant
        if quant is None or quant.layout != "pagedllm" or quant.max_rows < self.rows:
            raise Unsupported(f"{type(linear).__name__} without pagedllm's weight-only kernels for {self.rows} rows")
        qweight, scales = self._dense(quant.qweight), self._dense(quant.scales)
        if quant.method == "int8":
            call = cpu_kernels.bind_w8a16_linear(x, qweight, scales, bias, out, self.nthreads)
        else:
            call = cpu_kernels.bind_w4a16_linear(x, qweight, scales, quant.group_size, bias, out, self.nthreads)
        self.calls.append(call)

    def _attention(self, attn_mod: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        """out = o_proj(attention(q/k norm + rotary of qkv_proj(x))), writing this step's K/V."""
        attn, rope = attn_mod.attn, attn_mod.rotary_emb
        hq, hk, d = attn_mod.num_heads, attn_mod.num_kv_heads, attn_mod.head_dim
        if d % 32 or rope.rotary_dim % 32 or not rope.rotary_dim <= d <= 1024 or rope.cos_cache.dtype != torch.float32:
            raise Unsupported("head or rotary sizes the kernels do not take")
        quant = attn.kv_quant
        if (attn.kv_cache.numel() == 0 or (quant is None and attn.kv_cache.dtype != self.dtype)
                or attn.logits_soft_cap):
            raise Unsupported("KV cache or logit soft-capping")
        n, b = self.rows, self.buffers
        qkv, q, k, o = b.qkv[:n], b.q[:n], b.k[:n], b.o[:n]
        if qkv.shape[1] != (hq + 2 * hk) * d or q.shape[1:] != (hq, d):
            raise Unsupported("layers of different shapes")
        self._linear(attn_mod.qkv_proj, x, qkv)
        norms = None
        if getattr(attn_mod, "qk_norm", True):  # Gemma 3 always; a Llama-family model if it says so
            qn, kn = attn_mod.q_norm, attn_mod.k_norm
            q_w, k_w = qn.kernel_weight(qkv), kn.kernel_weight(qkv)
            if q_w is None or k_w is None or type(qn) is not type(kn) or qn.eps != kn.eps:
                raise Unsupported("q/k norms")
            norms = (self._dense(q_w), self._dense(k_w), qn.eps, qn.gemma_style)
        self.calls.append(cpu_kernels.bind_qk_norm_rope(
            qkv, hq, hk, d, norms, self._dense(rope.cos_cache), self._dense(rope.sin_cache), self.positions, q, k,
            self.nthreads))
        k_cache, v_cache = attn.kv_cache[0], attn.kv_cache[1]
        v = qkv[:, (hq + hk) * d :].view(n, hk, d)
        scales = None
        if quant is None:
            self.calls.append(partial(k_cache.view(-1, hk, d).index_copy_, 0, self.slot, k))
            self.calls.append(partial(v_cache.view(-1, hk, d).index_copy_, 0, self.slot, v))
        else:
            self.calls.append(cpu_kernels.bind_kv_cache_write(k, v, self.slot, self._dense(attn.kv_cache),
                                                              self._dense(attn.kv_scales), quant.kind, self.nthreads))
            scales = (attn.kv_scales[0], attn.kv_scales[1], quant.kind)
        self.calls.append(cpu_kernels.bind_paged_decode_attention(
            q, self._dense(k_cache), self._dense(v_cache), self.block_table, self.seq_len, attn.sliding_window,
            attn.scale, o, self.nthreads, scales=scales))
        self._linear(attn_mod.o_proj, o.view(n, hq * d), out)

    def _mlp(self, mlp: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        """out = down_proj(act(gate) * up) of x."""
        act_id = _ACT_IDS.get(type(mlp.act_fn))
        if act_id is None:
            raise Unsupported(f"activation {type(mlp.act_fn).__name__}")
        n, b = self.rows, self.buffers
        gate_up, act = b.gate_up[:n], b.act[:n]
        if act.shape[1] != mlp.down_proj.in_features:
            raise Unsupported("layers of different shapes")
        self._linear(mlp.gate_up_proj, x, gate_up)
        self.calls.append(cpu_kernels.bind_act_and_mul(gate_up, act_id, act, self.nthreads))
        self._linear(mlp.down_proj, act, out)

    def _add(self, x: torch.Tensor) -> None:
        """hidden += x: the pre-norm layers' residual adds (`hidden + x`, in place)."""
        self.calls.append(partial(torch.add, self.hidden, x, out=self.hidden))

    def _sandwich_layer(self, layer: torch.nn.Module) -> None:
        """Gemma3DecoderLayer.forward: a norm before and after attention and the MLP, the latter
        two adding the residual (the kernel reads each residual vector before writing it)."""
        proj = self.buffers.proj[: self.rows]
        self._rms(layer.input_layernorm, self.hidden, self.normed)
        self._attention(layer.self_attn, self.normed, proj)
        self._rms(layer.post_attention_layernorm, proj, self.hidden, residual=True)
        self._rms(layer.pre_feedforward_layernorm, self.hidden, self.normed)
        self._mlp(layer.mlp, self.normed, proj)
        self._rms(layer.post_feedforward_layernorm, proj, self.hidden, residual=True)

    def _pre_norm_layer(self, layer: torch.nn.Module) -> None:
        """LlamaDecoderLayer.forward: hidden + attention(norm(hidden)), then + mlp(norm(hidden))."""
        proj = self.buffers.proj[: self.rows]
        self._rms(layer.input_layernorm, self.hidden, self.normed)
        self._attention(layer.self_attn, self.normed, proj)
        self._add(proj)
        self._rms(layer.post_attention_layernorm, self.hidden, self.normed)
        self._mlp(layer.mlp, self.normed, proj)
        self._add(proj)

    # -- running --

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The final-normed hidden states [rows, hidden] of the step's tokens: decodes, and the
        rows of short chunks, each as a decode of the keys up to its own position."""
        if self.embed_scale is None:
            self.hidden.copy_(self.embed.lookup(input_ids))
        else:
            torch.mul(self.embed.lookup(input_ids), self.embed_scale, out=self.hidden)
        self._write_step(positions, md)
        for call in self.calls:
            call()
        if self.aux.shape[1]:
            self.trunk.aux_hidden_states = self.aux.clone()
        return self.normed.clone()

    def _write_step(self, positions: torch.Tensor, md: AttentionMetadata) -> None:
        """The step's positions, slots, and each row's keys and blocks, into the input buffers."""
        self.positions.copy_(positions.view(-1))
        self.slot.copy_(md.slot_mapping.view(-1))
        lens, table = self._seq_len_np, self._table_np
        if md.decode_token_idx is not None:
            tables = md.decode_block_tables
            if not md.prefills:  # decodes only: rows in order
                lens[:] = md.decode_seq_lens
                table[:, : tables.shape[1]] = tables.numpy()
            else:
                rows = md.decode_token_idx.numpy()
                lens[rows] = md.decode_seq_lens
                table[rows, : tables.shape[1]] = tables.numpy()
        for seg in md.prefills:
            rows = slice(seg.token_start, seg.token_start + seg.query_len)
            lens[rows] = np.arange(seg.context_len + 1, seg.context_len + seg.query_len + 1)
            table[rows, : seg.block_table.shape[0]] = seg.block_table.numpy()


# Each layer `forward` a plan replays, and the recipe that does; the attention and feed-forward
# `forward`s the recipes replay.
_LAYER_RECIPES = {Gemma3DecoderLayer.forward: DecodePlan._sandwich_layer,
                  LlamaDecoderLayer.forward: DecodePlan._pre_norm_layer}
_ATTENTION_FORWARDS = (Gemma3Attention.forward, LlamaAttention.forward)


def _recipe(layer: torch.nn.Module) -> Callable[[DecodePlan, torch.nn.Module], None]:
    """The recipe replaying `layer`; Unsupported unless its attention and feed-forward block are
    ones the recipes replay too."""
    recipe = _LAYER_RECIPES.get(type(layer).forward)
    if (recipe is None or type(layer.self_attn).forward not in _ATTENTION_FORWARDS
            or type(layer.mlp).forward is not GatedMLP.forward):
        raise Unsupported(f"layer {type(layer).__name__}, or its attention or feed-forward block")
    return recipe


def rows_run_as_decodes(md: AttentionMetadata, max_blocks: int, windows: set[int | None]) -> bool:
    """Whether every row of the step runs as a decode in the module path's attention under each
    of `windows`, within block tables `max_blocks` wide: decodes, and chunks of at most
    KERNEL_CHUNK_ROWS rows after cached context over at most KERNEL_CHUNK_MAX_KEYS keys."""
    if md.decode_block_tables is not None and md.decode_block_tables.shape[1] > max_blocks:
        return False
    return all(seg.block_table.shape[0] <= max_blocks and all(chunk_runs_as_decodes(seg, w) for w in windows)
               for seg in md.prefills)


class DecodePlans:
    """A model's plans by row count, on one set of buffers; dropped (`valid` False) when the KV
    cache or the thread count changes."""

    def __init__(self, model: torch.nn.Module) -> None:
        """Raises Unsupported where the model can run no plan."""
        trunk = getattr(model, model.trunk_name, None) if isinstance(model, DecoderForCausalLM) else None
        stack = type(trunk)
        if (type(model).forward is not DecoderForCausalLM.forward or stack.forward is not DecoderStack.forward
                or stack.finish is not DecoderStack.finish or not stack.layers_take_positions):
            raise Unsupported(f"{type(model).__name__}: not a decoder stack the plans know")
        layers = list(trunk.stage_layers)
        for layer in layers:  # before anything reads their parts
            _recipe(layer)
        device = next(model.parameters()).device
        if device.type != "cpu":  # checked before kernels(), which builds them on its first call
            raise Unsupported(f"a model on {device}: the kernels are CPU ones")
        if cpu_kernels.kernels() is None or not layers or trunk.start_layer != 0 or trunk.end_layer != len(layers):
            raise Unsupported("no C kernels, or a pipeline stage")
        dtype = getattr(trunk, trunk.embed_name).dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise Unsupported(f"dtype {dtype}")
        kv_cache = layers[0].self_attn.attn.kv_cache
        if kv_cache.numel() == 0:
            raise Unsupported("no KV cache bound")
        self.trunk = trunk
        self.kv_ptr, self.nthreads = kv_cache.data_ptr(), torch.get_num_threads()
        self.windows = {layer.self_attn.attn.sliding_window for layer in layers}
        self.buffers = PlanBuffers.of_trunk(trunk, MAX_PLAN_ROWS, dtype)
        self.plans = {1: DecodePlan(trunk, 1, self.buffers)}  # raises Unsupported for the model's layers
        self.max_blocks = self.plans[1].block_table.shape[1]  # the block tables' width

    def valid(self, kv_cache: torch.Tensor) -> bool:
        return kv_cache.data_ptr() == self.kv_ptr and torch.get_num_threads() == self.nthreads

    def takes(self, md: AttentionMetadata) -> bool:
        """rows_run_as_decodes over the model's layers' windows. (A model with LoRA layers has
        no plans.)"""
        return rows_run_as_decodes(md, self.max_blocks, self.windows)

    def get(self, rows: int) -> DecodePlan | None:
        """The plan for `rows` decode tokens (built now if this is the first such step); None
        above MAX_PLAN_ROWS or the decoder kernels' own row limit."""
        plan = self.plans.get(rows)
        if plan is None and 1 < rows <= MAX_PLAN_ROWS:
            try:
                plan = DecodePlan(self.trunk, rows, self.buffers)
            except Unsupported:
                plan = False  # e.g. more rows than a linear's kernel takes
            self.plans[rows] = plan
        return plan or None


class DecodePlanRunner:
    """The model runner's use of the plans: set up on the first step with a decode (again if the
    KV cache or the thread count changes), then, each step, the plan for its row count when the
    step can run one (decodes, and short chunks after cached context); None: the module path,
    also where the model can run no plan, or with PAGEDLLM_DECODE_PLAN=0."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.plans: DecodePlans | None | bool = None  # False: none for this model

    def plan_for(self, num_tokens: int, md: AttentionMetadata) -> DecodePlan | None:
        plans = self.plans
        if plans is False or num_tokens > MAX_PLAN_ROWS or md.triton is not None:
            return None
        if plans is None or not plans.valid(self._kv_cache()):
            if md.decode_token_idx is None:
                return None  # set up on a step with a decode
            try:
                if not envs.PAGEDLLM_DECODE_PLAN:
                    raise Unsupported("PAGEDLLM_DECODE_PLAN=0")
                plans = DecodePlans(self.model)
            except Unsupported as e:
                logger.debug("decode plan off: %s", e)
                plans = False
            self.plans = plans
            if not plans:
                return None
        if not plans.takes(md):
            return None
        return plans.get(num_tokens)

    def _kv_cache(self) -> torch.Tensor:
        return self.plans.trunk.stage_layers[0].self_attn.attn.kv_cache

