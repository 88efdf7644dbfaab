"""A batch-1 decode step replayed as a fixed list of C kernel calls: the CPU analogue of a CUDA
graph. A lone decode's forward is ~250 small kernel calls whose Python around them (module
dispatch, shape checks, output allocation, pointer lookups) costs more than the kernels
themselves; the plan binds each call's arguments once (fixed buffers, raw pointers), so a step
only writes the token's position, slot, block table and length into its input buffers and
runs the calls. The kernels, their arguments and their order are those of the module path, so
its results are bit-identical to it (tests/model_executor/models/test_decode_plan.py).

Built by the models that support it (Gemma 3) on the first lone decode, only on the C kernel
path: one rank, weight-only quantized decoder linears in pagedllm's layout, no LoRA, float32
or bf16. Anything else keeps the module path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.forward_context import AttentionMetadata, get_lora_mask
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.model_executor.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm

_ACT_IDS = {SiluAndMul: cpu_kernels.ACTIVATIONS["silu"], GeluTanhAndMul: cpu_kernels.ACTIVATIONS["gelu_tanh"]}


class Unsupported(Exception):
    """The model, its weights or this step cannot run the plan; the module path runs."""


class DecodePlan:
    """Buffers and bound kernel calls for one token through a Gemma 3 stack (embedding scale,
    four norms per layer, fused q/k norm + rotary, sliding and global layers)."""

    def __init__(self, model: torch.nn.Module) -> None:
        lib = cpu_kernels.kernels()
        layers = list(model.layers)
        if lib is None or not layers or model.start_layer != 0 or model.end_layer != len(layers):
            raise Unsupported("no C kernels, or a pipeline stage")
        first = layers[0].self_attn
        dtype = model.embed_tokens.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise Unsupported(f"dtype {dtype}")
        self.dtype, self.nthreads = dtype, torch.get_num_threads()
        self.embed, self.embed_scale = model.embed_tokens, torch.tensor(model.embed_scale, dtype=dtype)
        hidden_size = self.embed.weight.shape[1]
        self.kv_ptr = first.attn.kv_cache.data_ptr()
        if first.attn.kv_cache.numel() == 0:
            raise Unsupported("no KV cache bound")
        block_size = first.attn.kv_cache.shape[2]
        self.block_size = block_size
        max_blocks = math.ceil(first.rotary_emb.cos_cache.shape[0] / block_size) + 1
        # per-step inputs, written in place
        self.positions = torch.zeros(1, dtype=torch.int64)
        self.slot = torch.zeros(1, dtype=torch.int64)
        self.seq_len = torch.zeros(1, dtype=torch.int64)
        self.block_table = torch.zeros(1, max_blocks, dtype=torch.int64)
        self._seq_len_np, self._table_np = self.seq_len.numpy(), self.block_table.numpy()[0]
        self.hidden = torch.zeros(1, hidden_size, dtype=dtype)
        self.normed = torch.zeros(1, hidden_size, dtype=dtype)
        self.calls: list[Callable[[], object]] = []
        for layer in layers:
            self._add_layer(layer)
        self._rms(model.norm, self.hidden, self.normed)

    # -- building --

    def _buffer(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype)  # the calls bound to it keep it alive

    @staticmethod
    def _dense(t: torch.Tensor) -> torch.Tensor:
        """A model tensor a bound call will point into: the kernels read it as dense."""
        if not t.is_contiguous():
            raise Unsupported("a non-contiguous operand")
        return t

    def _rms(self, norm: torch.nn.Module, x: torch.Tensor, out: torch.Tensor, residual: bool = False) -> None:
        """out = norm(x) (+ out, in place, with `residual`: the kernel reads each residual vector
        before writing it)."""
        if not isinstance(norm, GemmaRMSNorm):
            raise Unsupported(f"norm {type(norm).__name__}")
        w = self._dense(norm.kernel_weight(x))
        self.calls.append(cpu_kernels.bind_rms_norm(x, w, norm.eps, True, out if residual else None, out,
                                                    self.nthreads))

    def _linear(self, linear: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        quant = linear.quant
        if quant is None or quant.layout != "pagedllm" or quant.max_rows < 1 or linear.lora is not None:
            raise Unsupported(f"{type(linear).__name__} without pagedllm's weight-only kernels")
        if getattr(linear, "tp_size", 1) != 1:
            raise Unsupported("tensor parallel")
        bias = None if linear.bias is None else linear.bias.detach().to(self.dtype).contiguous()
        qweight, scales = self._dense(quant.qweight), self._dense(quant.scales)
        if quant.method == "int8":
            call = cpu_kernels.bind_w8a16_linear(x, qweight, scales, bias, out, self.nthreads)
        else:
            call = cpu_kernels.bind_w4a16_linear(x, qweight, scales, quant.group_size, bias, out, self.nthreads)
        self.calls.append(call)

    def _add_layer(self, layer: torch.nn.Module) -> None:
        attn_mod, mlp = layer.self_attn, layer.mlp
        attn, rope = attn_mod.attn, attn_mod.rotary_emb
        hq, hk, d = attn_mod.num_heads, attn_mod.num_kv_heads, attn_mod.head_dim
        if d % 32 or rope.rotary_dim % 32 or not rope.rotary_dim <= d <= 1024 or rope.cos_cache.dtype != torch.float32:
            raise Unsupported("head or rotary sizes the kernels do not take")
        if attn.kv_cache.numel() == 0 or attn.kv_cache.dtype != self.dtype:
            raise Unsupported("KV cache")
        qkv = self._buffer(1, (hq + 2 * hk) * d)
        q, k, o = self._buffer(1, hq, d), self._buffer(1, hk, d), self._buffer(1, hq, d)
        proj = self._buffer(1, self.hidden.shape[1])
        inter = mlp.down_proj.in_features
        gate_up, act = self._buffer(1, 2 * inter), self._buffer(1, inter)

        self._rms(layer.input_layernorm, self.hidden, self.normed)
        self._linear(attn_mod.qkv_proj, self.normed, qkv)
        qn, kn = attn_mod.q_norm, attn_mod.k_norm
        q_w, k_w = qn.kernel_weight(qkv), kn.kernel_weight(qkv)
        if not isinstance(qn, GemmaRMSNorm) or type(qn) is not type(kn) or qn.eps != kn.eps:
            raise Unsupported("q/k norms")
        norms = (self._dense(q_w), self._dense(k_w), qn.eps, True)
        self.calls.append(cpu_kernels.bind_qk_norm_rope(
            qkv, hq, hk, d, norms, self._dense(rope.cos_cache), self._dense(rope.sin_cache), self.positions, q, k,
            self.nthreads))
        k_cache, v_cache = attn.kv_cache[0], attn.kv_cache[1]
        v = qkv[:, (hq + hk) * d :].view(1, hk, d)
        self.calls.append(partial(k_cache.view(-1, hk, d).index_copy_, 0, self.slot, k))
        self.calls.append(partial(v_cache.view(-1, hk, d).index_copy_, 0, self.slot, v))
        self.calls.append(cpu_kernels.bind_paged_decode_attention(
            q, self._dense(k_cache), self._dense(v_cache), self.block_table, self.seq_len, attn.sliding_window,
            attn.scale, o, self.nthreads))
        self._linear(attn_mod.o_proj, o.view(1, hq * d), proj)
        self._rms(layer.post_attention_layernorm, proj, self.hidden, residual=True)
        self._rms(layer.pre_feedforward_layernorm, self.hidden, self.normed)
        self._linear(mlp.gate_up_proj, self.normed, gate_up)
        act_id = _ACT_IDS.get(type(mlp.act_fn))
        if act_id is None:
            raise Unsupported(f"activation {type(mlp.act_fn).__name__}")
        self.calls.append(cpu_kernels.bind_act_and_mul(gate_up, act_id, act, self.nthreads))
        self._linear(mlp.down_proj, act, proj)
        self._rms(layer.post_feedforward_layernorm, proj, self.hidden, residual=True)

    # -- running --

    def accepts(self, input_ids: torch.Tensor, md: AttentionMetadata | None, kv_cache: torch.Tensor) -> bool:
        """Whether this step is one the plan was built for: one decode token, no adapter, the
        same KV cache and thread count."""
        return (
            md is not None
            and input_ids.numel() == 1
            and not md.prefills
            and md.decode_block_tables is not None
            and -(-int(md.decode_seq_lens[0]) // self.block_size) <= self._table_np.shape[0]
            and get_lora_mask() is None
            and kv_cache.data_ptr() == self.kv_ptr
            and torch.get_num_threads() == self.nthreads
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The final-normed hidden state [1, hidden] of the step's token."""
        torch.mul(F.embedding(input_ids, self.embed.weight), self.embed_scale, out=self.hidden)
        self.positions.copy_(positions.view(1))
        self.slot.copy_(md.slot_mapping.view(1))
        length = int(md.decode_seq_lens[0])
        blocks = -(-length // self.block_size)
        self._seq_len_np[0] = length
        self._table_np[:blocks] = np.asarray(md.decode_block_tables[0, :blocks])
        for call in self.calls:
            call()
        return self.normed.clone()
