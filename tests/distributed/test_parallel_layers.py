"""The tensor-parallel layers, sharded over two gloo ranks, against the unsharded computation.

Two spawned processes join one process group (one start-up for all checks, ~3 s); each builds
the full reference weights from the same seed, loads them through the parallel layers'
`weight_loader`s (which keep the rank's slice) and compares the outputs. Each check's result
per rank comes back as a file, and each test below asserts one check.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import get_tp_group
from tests.utils import free_port

TP = 2
_TIMEOUT_S = 120


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- checks, run on every rank ----------------------------------------------------------------

def check_column(rank: int) -> None:
    from pagedllm.model_executor.layers.linear import ColumnParallelLinear

    w, b, x = _rand(12, 16, seed=0), _rand(12, seed=1), _rand(5, 16, seed=2)
    for gather in (False, True):
        layer = ColumnParallelLinear(16, 12, bias=True, gather_output=gather)
        assert layer.weight.shape == (6, 16) and layer.bias.shape == (6,)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        with torch.no_grad():
            out = layer(x)
        full = F.linear(x, w, b)
        _close(out, full if gather else full[:, rank * 6 : (rank + 1) * 6])


def check_row(rank: int) -> None:
    from pagedllm.model_executor.layers.linear import RowParallelLinear

    w, b, x = _rand(10, 12, seed=3), _rand(10, seed=4), _rand(5, 12, seed=5)
    layer = RowParallelLinear(12, 10, bias=True)
    assert layer.weight.shape == (10, 6) and layer.bias.shape == (10,)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    with torch.no_grad():
        out = layer(x[:, rank * 6 : (rank + 1) * 6])
    _close(out, F.linear(x, w, b))  # the bias counted once


def check_merged_column_then_row(rank: int) -> None:
    """gate/up merged and column-split, then down row-split: the whole MLP, with one all-reduce."""
    from pagedllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    gate, up, down, x = _rand(8, 16, seed=6), _rand(8, 16, seed=7), _rand(16, 8, seed=8), _rand(3, 16, seed=9)
    gate_up = MergedColumnParallelLinear(16, [8, 8])
    gate_up.weight.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight.weight_loader(gate_up.weight, up, 1)
    down_proj = RowParallelLinear(8, 16)
    down_proj.weight.weight_loader(down_proj.weight, down)
    with torch.no_grad():
        local = gate_up(x)
        g, u = local.chunk(2, dim=-1)
        out = down_proj(F.silu(g) * u)
    rows = slice(rank * 4, (rank + 1) * 4)
    _close(local, torch.cat([F.linear(x, gate[rows]), F.linear(x, up[rows])], dim=-1))
    _close(out, F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down))


def _check_qkv(rank: int, num_heads: int, num_kv_heads: int) -> None:
    from pagedllm.model_executor.layers.linear import QKVParallelLinear

    d, hidden = 4, 16
    wq, wk, wv = _rand(num_heads * d, hidden, seed=10), _rand(num_kv_heads * d, hidden, seed=11), \
        _rand(num_kv_heads * d, hidden, seed=12)
    bq, bk, bv = _rand(num_heads * d, seed=13), _rand(num_kv_heads * d, seed=14), _rand(num_kv_heads * d, seed=15)
    x = _rand(3, hidden, seed=16)
    layer = QKVParallelLinear(hidden, d, num_heads, num_kv_heads, bias=True)
    for shard_id, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        layer.weight.weight_loader(layer.weight, w, shard_id)
        layer.bias.weight_loader(layer.bias, b, shard_id)
    heads, kv_heads = num_heads // TP, max(1, num_kv_heads // TP)
    assert (layer.num_heads, layer.num_kv_heads) == (heads, kv_heads)
    with torch.no_grad():
        q, k, v = layer(x).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    first_kv = rank * kv_heads if TP <= num_kv_heads else rank * num_kv_heads // TP
    q_cols = slice(rank * heads * d, (rank + 1) * heads * d)
    kv_cols = slice(first_kv * d, (first_kv + kv_heads) * d)
    _close(q, F.linear(x, wq, bq)[:, q_cols])
    _close(k, F.linear(x, wk, bk)[:, kv_cols])
    _close(v, F.linear(x, wv, bv)[:, kv_cols])


def check_qkv_split_kv_heads(rank: int) -> None:
    _check_qkv(rank, num_heads=4, num_kv_heads=2)


def check_qkv_replicated_kv_head(rank: int) -> None:
    """One kv head, two ranks: both hold it."""
    _check_qkv(rank, num_heads=4, num_kv_heads=1)


def check_fused_qkv_checkpoint_tensors(rank: int) -> None:
    """GPT-2's c_attn (q | k | v stacked, stored [in, out]) and GPT-NeoX's query_key_value
    (interleaved per head, [heads, 3, head_dim]): each rank keeps its heads of q, k and v."""
    from pagedllm.model_executor.layers.linear import QKVParallelLinear, fused_qkv_loader, transposed_loader

    heads, d, hidden = 4, 4, 16
    ws = [_rand(heads * d, hidden, seed=s) for s in (30, 31, 32)]
    bs = [_rand(heads * d, seed=s) for s in (33, 34, 35)]
    x = _rand(3, hidden, seed=36)
    cols = slice(rank * 2 * d, (rank + 1) * 2 * d)  # this rank's two heads
    expected = torch.cat([F.linear(x, w, b)[:, cols] for w, b in zip(ws, bs)], dim=-1)
    stacked = (torch.cat(ws).t().contiguous(), torch.cat(bs))
    interleaved = (torch.stack([w.view(heads, d, hidden) for w in ws], 1).reshape(-1, hidden),
                   torch.stack([b.view(heads, d) for b in bs], 1).reshape(-1))
    for is_interleaved, (w, b) in ((False, stacked), (True, interleaved)):
        layer = QKVParallelLinear(hidden, d, heads, heads, bias=True)
        load = fused_qkv_loader(layer, interleaved=is_interleaved)
        (load if is_interleaved else transposed_loader(load))(layer.weight, w)
        load(layer.bias, b)
        with torch.no_grad():
            _close(layer(x), expected)


def check_transposed_column_then_row(rank: int) -> None:
    """GPT-2's MLP: c_fc and c_proj stored [in, out], column- then row-split."""
    from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear, transposed_loader

    w1, b1, w2, b2, x = _rand(8, 16, seed=37), _rand(8, seed=38), _rand(16, 8, seed=39), _rand(16, seed=40), \
        _rand(3, 16, seed=41)
    fc, proj = ColumnParallelLinear(16, 8, bias=True), RowParallelLinear(8, 16, bias=True)
    for layer, w, b in ((fc, w1, b1), (proj, w2, b2)):
        transposed_loader(layer.weight.weight_loader)(layer.weight, w.t().contiguous())
        layer.bias.weight_loader(layer.bias, b)
    with torch.no_grad():
        _close(proj(F.gelu(fc(x))), F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2))


def check_vocab_embedding_padded(rank: int) -> None:
    """11 ids over 2 ranks: 6 rows each, the last of rank 1 padding."""
    from pagedllm.model_executor.layers.vocab_embedding import VocabParallelEmbedding

    w = _rand(11, 8, seed=17)
    emb = VocabParallelEmbedding(11, 8)
    assert emb.weight.shape == (6, 8) and (emb.vocab_start, emb.vocab_end) == (rank * 6, min(11, rank * 6 + 6))
    emb.weight.weight_loader(emb.weight, w)
    ids = torch.tensor([0, 5, 6, 10, 3, 10, 7])
    with torch.no_grad():
        out = emb(ids)
    assert torch.equal(out, F.embedding(ids, w))  # one rank's row plus zeros: exact


def check_lm_head(rank: int) -> None:
    """Own and tied weights, with and without softcap: every rank has the whole logits,
    padding dropped."""
    from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

    w, h = _rand(11, 8, seed=18), _rand(4, 8, seed=19)
    emb = VocabParallelEmbedding(11, 8)
    emb.weight.weight_loader(emb.weight, w)
    own = ParallelLMHead(11, 8)
    own.weight.weight_loader(own.weight, w)
    tied = ParallelLMHead(11, 8, tied_to=emb)
    full = F.linear(h, w)
    for head in (own, tied):
        with torch.no_grad():
            _close(head(h), full)
            _close(head(h, softcap=2.0), torch.tanh(full / 2.0) * 2.0)


def check_packed_and_quantized_shards(rank: int) -> None:
    """loader/cpu_pack.py and loader/quantize.py run on each rank's shard."""
    from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from pagedllm.model_executor.layers.vocab_embedding import ParallelLMHead
    from pagedllm.model_executor.loader.cpu_pack import pack_model
    from pagedllm.model_executor.loader.quantize import quantize_model

    w1, w2, wh, x = _rand(64, 32, seed=20) * 0.1, _rand(32, 64, seed=21) * 0.1, _rand(33, 32, seed=22), \
        _rand(3, 32, seed=23)
    ref = F.linear(F.linear(F.linear(x, w1), w2), wh)
    for mode in (None, "int8"):
        model = nn.Sequential(ColumnParallelLinear(32, 64), RowParallelLinear(64, 32), ParallelLMHead(33, 32))
        for layer, w in zip(model, (w1, w2, wh)):
            layer.weight.weight_loader(layer.weight, w)
        with torch.no_grad():
            if mode:
                quantize_model(model, mode)
                assert (model[0].quant.in_features, model[0].quant.out_features) == (32, 32)
                assert (model[1].quant.in_features, model[1].quant.out_features) == (32, 32)
            pack_model(model)
            out = model(x)
        assert out.shape == (3, 33)
        if mode is None:
            _close(out, ref)
        else:
            assert float((out - ref).norm() / ref.norm()) < 0.03


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}


def _run_checks(rank: int, port: int, out_dir: str) -> None:
    from pagedllm.distributed import (
        destroy_distributed_environment,
        init_distributed_environment,
        initialize_model_parallel,
    )

    torch.set_num_threads(1)
    init_distributed_environment(TP, rank, f"tcp://127.0.0.1:{port}", "gloo")
    initialize_model_parallel(TP)
    assert get_tp_group().world_size == TP and get_tp_group().rank_in_group == rank
    results = {}
    for name, check in CHECKS.items():
        try:
            check(rank)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    destroy_distributed_environment()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out_dir = str(tmp_path_factory.mktemp("tp_layers"))
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_run_checks, args=(rank, port, out_dir)) for rank in range(TP)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(_TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    for rank, p in enumerate(procs):
        assert p.exitcode == 0, f"rank {rank} exited with {p.exitcode}"
    out = []
    for rank in range(TP):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            out.append(json.load(f))
    return out


@pytest.mark.parametrize("name", list(CHECKS))
def test_sharded_layer_matches_unsharded(results, name):
    errors = [f"rank {rank}:\n{r[name]}" for rank, r in enumerate(results) if r[name] is not None]
    assert not errors, "\n".join(errors)


def test_one_rank_needs_no_process_group():
    """Without a process group the collectives are identities (no torch.distributed call)."""
    import torch.distributed as dist

    group = get_tp_group()
    x = torch.arange(6.0).view(2, 3)
    assert (group.world_size, group.rank_in_group) == (1, 0) and not dist.is_initialized()
    assert group.all_reduce(x) is x and group.all_gather(x, dim=-1) is x
