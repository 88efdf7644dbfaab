"""Mixture-of-experts models (Mixtral, Qwen3-MoE) and their FusedMoE layer: the layer against a
per-token reference (also split over two simulated ranks), both checkpoint layouts, greedy tokens
and logprobs against transformers (float32) in the scenarios of test_models.py, quantized
loading, and tensor_parallel_size=2."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model_executor.layers import fused_moe
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from tests.model_executor.models.test_models import MAX_TOKENS, PROMPTS, SCENARIOS
from tests.utils import assert_greedy_match, build_tokenizer, hf_greedy, save_tiny_model

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)


def moe_config(arch: str, vocab_size: int):
    from transformers import MixtralConfig, Qwen3MoeConfig

    if arch == "mixtral":  # renormalized top-2 of 4 experts
        return MixtralConfig(vocab_size=vocab_size, intermediate_size=32, num_local_experts=4, **COMMON)
    # top-2 of 8 unnormalized; layer 0 is a dense MLP
    return Qwen3MoeConfig(vocab_size=vocab_size, intermediate_size=48, moe_intermediate_size=32, num_experts=8,
                          norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=1, **COMMON)


def make_moe_model(path: str, arch: str) -> str:
    tok = build_tokenizer(path)
    return save_tiny_model(path, moe_config(arch, len(tok)))


# ---- the layer ---------------------------------------------------------------------------------------------------

E, H, INTER, TOP_K = 6, 16, 8, 2


def naive_moe(x, logits, w1, w3, w2, renormalize):
    """One token at a time: softmax, top-k, (renormalize), weighted sum of the experts' SiLU MLPs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].float(), -1)
        weights, ids = probs.topk(TOP_K)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids.tolist()):
            out[t] += w * (w2[e] @ (torch.nn.functional.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
    return out


def expert_weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(E, *shape, generator=g) * 0.3 for shape in ((INTER, H), (INTER, H), (H, INTER))]


def routed_batch(tokens: int = 11):
    """A batch whose router never picks experts 4 and 5."""
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(tokens, H, generator=g), torch.randn(tokens, E, generator=g)
    logits[:, 4:] = -30.0
    return x, logits


def load_per_expert(layer: FusedMoE, w1, w3, w2) -> None:
    for e in range(E):
        for shard, w in (("w1", w1), ("w3", w3)):
            layer.weight_loader(layer.w13_weight, w[e], shard, e)
        layer.weight_loader(layer.w2_weight, w2[e], "w2", e)


class _FakeRank(GroupCoordinator):
    """Rank `rank` of two whose all-reduce is left to the test (it sums the ranks' outputs)."""

    def __init__(self, rank: int) -> None:
        super().__init__([0, 1], rank)

    def all_reduce(self, x):
        return x


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_matches_per_token_reference(renormalize):
    w1, w3, w2 = expert_weights()
    x, logits = routed_batch()
    layer = FusedMoE(E, TOP_K, H, INTER, renormalize)
    load_per_expert(layer, w1, w3, w2)
    assert set(layer.route(logits)[1].flatten().tolist()) <= {0, 1, 2, 3}  # experts 4, 5 idle
    torch.testing.assert_close(layer(x, logits), naive_moe(x, logits, w1, w3, w2, renormalize))
    one = layer(x[3:4], logits[3:4])  # a lone token: its own experts only
    torch.testing.assert_close(one, naive_moe(x[3:4], logits[3:4], w1, w3, w2, renormalize))


def test_fused_moe_stacked_layout_and_two_ranks(monkeypatch):
    """transformers' stacked tensors load as the per-expert ones do; two ranks, each with half of
    every expert's intermediate dimension, sum to the one-rank output."""
    w1, w3, w2 = expert_weights()
    x, logits = routed_batch()
    whole = FusedMoE(E, TOP_K, H, INTER, True)
    load_per_expert(whole, w1, w3, w2)
    stacked = FusedMoE(E, TOP_K, H, INTER, True)
    stacked.weight_loader(stacked.w13_weight, torch.cat([w1, w3], dim=1), "w13", None)
    stacked.weight_loader(stacked.w2_weight, w2, "w2", None)
    assert torch.equal(stacked.w13_weight, whole.w13_weight) and torch.equal(stacked.w2_weight, whole.w2_weight)
    want = whole(x, logits)
    for per_expert in (True, False):
        parts = []
        for rank in (0, 1):
            monkeypatch.setattr(fused_moe, "get_tp_group", lambda r=rank: _FakeRank(r))
            layer = FusedMoE(E, TOP_K, H, INTER, True)
            assert layer.w13_weight.shape == (E, INTER, H) and layer.w2_weight.shape == (E, H, INTER // 2)
            if per_expert:
                load_per_expert(layer, w1, w3, w2)
            else:
                layer.weight_loader(layer.w13_weight, torch.cat([w1, w3], dim=1), "w13", None)
                layer.weight_loader(layer.w2_weight, w2, "w2", None)
            parts.append(layer(x, logits))
        torch.testing.assert_close(parts[0] + parts[1], want)


# ---- the models ----------------------------------------------------------------------------------------------------

ARCHS = ["mixtral", "qwen3_moe"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny_moe(request, tmp_path_factory):
    path = make_moe_model(str(tmp_path_factory.mktemp(request.param)), request.param)
    return path, hf_greedy(path, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers(tiny_moe, scenario):
    path, ref = tiny_moe
    llm = LLM(path, dtype="float32", **SCENARIOS[scenario])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_greedy_match([o.outputs[0].token_ids for o in outs], ref)
    stats = llm.llm_engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"
    if scenario == "preemption":
        assert stats["num_preemptions"] > 0
    if scenario == "plain":
        # Alone, each prompt gives the tokens it gave in the batch; a rerun hits the prefix cache.
        for prompt, ref_one in zip(PROMPTS[:2], ref[:2]):
            alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            assert_greedy_match([alone], [ref_one])
        again = llm.generate(PROMPTS, params, use_tqdm=False)
        assert_greedy_match([o.outputs[0].token_ids for o in again], ref)
        assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0


def test_logprobs_match_transformers(tiny_moe):
    path, ref = tiny_moe
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 24, max_num_batched_tokens=16)  # chunked prefills
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    for prompt, want in zip(PROMPTS[:2], ref[:2]):
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == want["tokens"][:8]
        for tok_id, entry, lp in zip(out.token_ids, out.logprobs, want["logprobs"]):
            top = lp.topk(5)
            assert set(entry) == {tok_id} | set(top.indices.tolist())
            for rank, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
                assert entry[i].rank == rank and abs(entry[i].logprob - v) < 1e-3


def test_both_checkpoint_layouts_load_the_same_weights(tiny_moe, tmp_path):
    """The per-expert tensors save_pretrained writes (block_sparse_moe.experts.N.w1 for Mixtral) and
    transformers' in-memory stacked ones (mlp.experts.gate_up_proj) fill the same parameters; a
    checkpoint lacking an expert is refused."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedllm.model_executor.models.registry import resolve_model_cls
    from pagedllm.transformers_utils.weight_utils import iterate_checkpoint

    path, _ = tiny_moe
    config = AutoConfig.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    stacked = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in stacked)
    save_file(stacked, str(tmp_path / "model.safetensors"))
    cls = resolve_model_cls(config.architectures[0])
    models = []
    for src in (path, str(tmp_path)):
        model = cls(config)
        model.load_weights(iterate_checkpoint(src))
        models.append(model.state_dict())
    assert models[0].keys() == models[1].keys()
    for k in models[0]:
        assert torch.equal(models[0][k], models[1][k]), k
    with pytest.raises(ValueError, match="missing expert weights"):
        cls(config).load_weights((n, t) for n, t in iterate_checkpoint(path) if ".experts.1." not in n)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_model_keeps_experts_float(tiny_moe, quantization):
    """The experts and router are not Linears: quantization leaves them in float (attention is
    quantized), and the model runs."""
    path, _ = tiny_moe
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22, quantization=quantization)
    model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
    moe = [m for m in model.modules() if isinstance(m, fused_moe.SparseMoeBlock)]
    assert moe and all(m.experts.w13_weight.dtype == m.gate.weight.dtype == torch.float32 for m in moe)
    assert model.model.layers[0].self_attn.qkv_proj.quant is not None
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_greedy_tokens_equal_one_rank(arch, tmp_path):
    """Two worker processes, each with half of every expert (and half the heads): ~7 s per arch."""
    path = make_moe_model(str(tmp_path), arch)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = PROMPTS[:3]
    one = LLM(path, dtype="float32", kv_cache_memory=1 << 22)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = LLM(path, dtype="float32", kv_cache_memory=1 << 22, tensor_parallel_size=2)
    try:
        assert len(two.llm_engine.engine_core.model_executor.worker_pids) == 2
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        two.llm_engine.engine_core.shutdown()


def test_expert_size_that_does_not_split_is_refused(tmp_path):
    from pagedllm.engine.arg_utils import EngineArgs

    tok = build_tokenizer(str(tmp_path))
    config = moe_config("qwen3_moe", len(tok))
    config.moe_intermediate_size = 34
    save_tiny_model(str(tmp_path), config)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not fit .*: moe_intermediate_size=34 is not"):
        EngineArgs(model=str(tmp_path), tensor_parallel_size=4).create_engine_config()
