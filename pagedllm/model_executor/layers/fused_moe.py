"""Mixture-of-experts feed-forward: a router picks `top_k` experts per token, each expert is a
gated MLP, and the token's output is the routing-weighted sum of its experts' outputs.

All experts' weights are stacked in two parameters, so a step runs one pair of GEMMs per expert
that received tokens (not one per token): the batch's (token, expert) pairs are sorted by expert,
each expert's tokens are gathered, and the weighted results are scattered back with index_add_.

Under tensor parallelism every rank holds every expert, with a slice of its intermediate
dimension (gate/up rows, down columns, as MergedColumnParallelLinear / RowParallelLinear split a
dense MLP); the partial sums of all experts are all-reduced once per layer.

The experts are not `Linear`s: `--quantization` (loader/quantize.py) and the CPU packing
(loader/cpu_pack.py) leave them, and the router, in the model's float dtype.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import get_tp_group
from pagedllm.model_executor.layers.activation import get_act_and_mul
from pagedllm.model_executor.layers.linear import divide, load_slice


class FusedMoE(nn.Module):
    """`w13_weight` [E, 2 * I_rank, H] holds each expert's [gate_rank; up_rank] rows and
    `w2_weight` [E, H, I_rank] its down-projection columns. Their `weight_loader(param, tensor,
    shard, expert)` takes one expert's checkpoint matrix (shard "w1" gate, "w3" up, "w2" down),
    or, with expert None, all experts stacked as transformers keeps them in memory (shard "w13":
    [E, 2 * I, H] gate then up; "w2": [E, H, I])."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, hidden_act: str = "silu") -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.tp_rank, tp_size = self.tp.rank_in_group, self.tp.world_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size  # the checkpoint's, all ranks together
        inter = divide(intermediate_size, tp_size, "expert intermediate size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.act_fn = get_act_and_mul(hidden_act)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str, expert: int | None) -> None:
        inter, full = self.w2_weight.shape[2], self.intermediate_size
        start = self.tp_rank * inter
        target = param.data if expert is None else param.data[expert]
        dim = 1 if expert is None else 0  # the rows of a [E, rows, cols] stack or of one matrix
        what = f"expert {'(all)' if expert is None else expert} {shard}"
        if shard == "w2":
            load_slice(target, loaded, dim + 1, start, full, what)
        elif shard == "w13":
            load_slice(target.narrow(dim, 0, inter), loaded, dim, start, 2 * full, what)
            load_slice(target.narrow(dim, inter, inter), loaded, dim, full + start, 2 * full, what)
        elif shard in ("w1", "w3"):
            load_slice(target.narrow(dim, 0 if shard == "w1" else inter, inter), loaded, dim, start, full, what)
        else:
            raise ValueError(f"unknown expert shard {shard!r}")

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k (weights [T, k] in float32, expert ids [T, k]) from a softmax over
        all experts, renormalized over the k when asked."""
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(router_logits)
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            idx = tokens[start:start + n]
            h = self.act_fn(F.linear(x[idx], self.w13_weight[expert]))
            y = F.linear(h, self.w2_weight[expert]) * pair_weights[start:start + n, None]
            out.index_add_(0, idx, y.to(out.dtype))
            start += n
        return self.tp.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """Router `gate` (no bias; a plain float nn.Linear, never quantized, so routing stays the
    checkpoint's) and the `experts`."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, hidden_act: str = "silu") -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


# "<prefix>.experts.<id>.<proj>.weight" (one expert, as published checkpoints store them) or
# "<prefix>.experts.gate_up_proj" / ".down_proj" (all experts stacked, transformers' in-memory layout).
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(?:(\d+)\.(\w+)\.weight|(gate_up_proj|down_proj))$")


def expert_param(name: str, shards: dict[str, str]) -> tuple[str, tuple] | None:
    """The FusedMoE parameter a checkpoint tensor loads into, and its loader's (shard, expert);
    None if `name` is no expert weight. `shards` maps the checkpoint's per-expert module names to
    "w1" (gate), "w3" (up), "w2" (down)."""
    m = _EXPERT_NAME.match(name)
    if m is None:
        return None
    prefix, expert, proj, stacked = m.groups()
    if stacked is not None:
        shard = "w13" if stacked == "gate_up_proj" else "w2"
        return f"{prefix}.{shard}_weight", (shard, None)
    shard = shards.get(proj)
    if shard is None:
        return None
    return f"{prefix}.{'w2' if shard == 'w2' else 'w13'}_weight", (shard, int(expert))


class ExpertRouter:
    """`route` for models/utils.load_weights: sends expert tensors to their FusedMoE parameter and
    remembers which (shard, expert) each got, so `check` can name an expert the checkpoint lacks
    (load_weights sees only that the stacked parameter was written at all)."""

    def __init__(self, shards: dict[str, str], rename: tuple[str, str] | None = None) -> None:
        self.shards, self.rename = shards, rename
        self.seen: dict[str, set[tuple[str, int | None]]] = {}

    def __call__(self, name: str) -> tuple[str, tuple] | None:
        renamed = name.replace(*self.rename) if self.rename is not None else name
        routed = expert_param(renamed, self.shards)
        if routed is None:
            return (renamed, ()) if renamed != name else None
        self.seen.setdefault(routed[0], set()).add(routed[1])
        return routed

    def check(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            if not isinstance(module, FusedMoE):
                continue
            for param, shards in ((f"{name}.w13_weight", ("w1", "w3")), (f"{name}.w2_weight", ("w2",))):
                got = self.seen.get(param, set())
                if (("w13" if param.endswith("w13_weight") else "w2"), None) in got:
                    continue
                lacking = [(s, e) for e in range(module.num_experts) for s in shards if (s, e) not in got]
                if lacking:
                    raise ValueError(f"checkpoint is missing expert weights of {name}: {lacking[:4]}")
