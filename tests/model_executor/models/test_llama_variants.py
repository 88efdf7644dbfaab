"""Phi-3 (fused qkv / gate_up checkpoint tensors, partial rotary, LongRoPE, sliding window), Granite
(its four multipliers), StarCoder2 (LayerNorm with bias, biased projections, GELU MLP, tied
embeddings) and Mistral with a sliding window: greedy float32 output equals transformers', token for
token, in test_models.py's scenarios, with logprobs; and, but for Granite, the same tokens over two
tensor-parallel ranks."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.model_executor.models.test_models import MAX_TOKENS, PROMPTS, SCENARIOS
from tests.utils import assert_greedy_match, build_tokenizer, hf_greedy, save_tiny_model

ARCHS = ["phi3", "granite", "starcoder2", "mistral"]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def variant_config(arch: str, vocab_size: int, **overrides):
    """A tiny config; sliding windows (8 to 20 tokens) shorter than most prompts, so they bite."""
    from transformers import GraniteConfig, MistralConfig, Phi3Config, Starcoder2Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    specific = {
        "phi3": (Phi3Config, dict(sliding_window=20, partial_rotary_factor=0.5)),
        "granite": (GraniteConfig, dict(embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.5,
                                        logits_scaling=4.0)),
        "starcoder2": (Starcoder2Config, dict(sliding_window=12, hidden_act="gelu_pytorch_tanh", use_bias=True,
                                              norm_epsilon=1e-5, tie_word_embeddings=True)),
        # head_dim 32: on CPU the windowed decodes run pagedllm's C attention kernel.
        "mistral": (MistralConfig, dict(head_dim=32, sliding_window=8)),
    }
    if arch not in specific:
        raise ValueError(arch)
    cls, kwargs = specific[arch]
    return cls(**{**common, **kwargs, **overrides})


def make_variant(path: str, arch: str, **overrides) -> str:
    tok = build_tokenizer(path)
    config = variant_config(arch, len(tok), **overrides)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return save_tiny_model(path, config)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = make_variant(str(tmp_path_factory.mktemp(request.param)), request.param)
    return path, hf_greedy(path, PROMPTS, MAX_TOKENS)


def assert_logprobs_match(outs, ref) -> None:
    """Top-5 logprobs of each step up to the first token that differs (a near-tie) within 1e-3."""
    for out, r in zip(outs, ref):
        for tok_id, want, entry, lp in zip(out.token_ids, r["tokens"], out.logprobs, r["logprobs"]):
            if tok_id != want:
                break
            top = lp.topk(5)
            assert set(entry) == {tok_id} | set(top.indices.tolist())
            for rank, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
                assert entry[i].rank == rank and abs(entry[i].logprob - v) < 1e-3


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers(tiny, scenario):
    path, ref = tiny
    llm = LLM(path, dtype="float32", **SCENARIOS[scenario])
    params = WITH_LOGPROBS if scenario == "plain" else GREEDY
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert_greedy_match([o.token_ids for o in outs], ref)
    stats = llm.llm_engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"
    if scenario == "preemption":
        assert stats["num_preemptions"] > 0
    if scenario == "plain":
        assert_logprobs_match(outs, ref)
        # Again, now from the prefix cache.
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_greedy_match([o.outputs[0].token_ids for o in again], ref)
        assert any(o.num_cached_tokens > 0 for o in again)


def test_phi3_longrope_factor_set_follows_max_model_len(tmp_path):
    """original_max_position_embeddings 32: an engine of max_model_len 32 rotates with the short
    factors (as transformers does for sequences that never pass 32 tokens), a longer one with the long
    factors (as transformers does once the prompt alone is longer than 32)."""
    short = [1.0, 1.5, 2.0, 4.0]  # rotary dim 8 (head 16, partial factor 0.5): 4 factors per set
    rope = {"rope_type": "longrope", "short_factor": short, "long_factor": [f * 6 for f in short],
            "original_max_position_embeddings": 32}
    path = make_variant(str(tmp_path), "phi3", rope_scaling=rope, original_max_position_embeddings=32)
    short_prompts = [p for p in PROMPTS if len(p) + MAX_TOKENS <= 32]
    long_prompts = [p for p in PROMPTS if len(p) > 32]
    assert len(short_prompts) >= 2 and len(long_prompts) >= 2
    llms = {n: LLM(path, dtype="float32", kv_cache_memory=1 << 24, max_model_len=n) for n in (32, 512)}

    def run(max_model_len, prompts):
        return [o.outputs[0].token_ids for o in llms[max_model_len].generate(prompts, GREEDY, use_tqdm=False)]

    short_tokens = run(32, short_prompts)
    assert_greedy_match(short_tokens, hf_greedy(path, short_prompts, MAX_TOKENS))
    assert_greedy_match(run(512, long_prompts), hf_greedy(path, long_prompts, MAX_TOKENS))
    assert run(512, short_prompts) != short_tokens  # the two sets do differ


def test_split_fused_cuts_checkpoint_tensors_unread(tmp_path):
    """A fused tensor in a safetensors file is cut into row ranges that read (whole or narrowed)
    as the slices of the tensor; other tensors pass through."""
    import torch
    from safetensors.torch import save_file

    from pagedllm.model_executor.models.utils import split_fused
    from pagedllm.transformers_utils.weight_utils import iterate_checkpoint

    fused, other = torch.randn(10, 3), torch.randn(4)
    save_file({"a.qkv_proj.weight": fused, "a.norm.weight": other}, str(tmp_path / "model.safetensors"))
    spec = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), (6, 2, 2))}
    got = {}
    for name, t in split_fused(iterate_checkpoint(str(tmp_path)), spec):
        got[name] = t.load()
        if name.endswith("k_proj.weight"):
            assert torch.equal(t.narrow(0, 1, 1), fused[7:8]) and torch.equal(t.narrow(1, 1, 2), fused[6:8, 1:])
    assert sorted(got) == ["a.k_proj.weight", "a.norm.weight", "a.q_proj.weight", "a.v_proj.weight"]
    assert torch.equal(got["a.q_proj.weight"], fused[:6]) and torch.equal(got["a.v_proj.weight"], fused[8:])
    assert torch.equal(got["a.norm.weight"], other)
    with pytest.raises(ValueError, match="11 rows, expected 6 \\+ 2 \\+ 2"):
        list(split_fused([("b.qkv_proj.weight", torch.zeros(11, 3))], spec))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["phi3", "starcoder2", "mistral"])  # Granite's multipliers do not meet the split
def test_tp2_greedy_tokens_equal_one_rank(arch, tmp_path):
    """Two ranks: Phi-3's fused tensors cut per rank, StarCoder2's biases added once, Mistral's window."""
    path = make_variant(str(tmp_path), arch)
    prompts = PROMPTS[:3]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    one = LLM(path, dtype="float32", kv_cache_memory=1 << 22)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = LLM(path, dtype="float32", kv_cache_memory=1 << 22, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        two.llm_engine.engine_core.shutdown()
