"""EAGLE-3 heads as drafters, in the Hub layout: each draft equals a plain-torch reference of the
head over transformers' hidden states of the target (Llama, Qwen3 and Gemma 3), through a draft
vocabulary smaller than the target's; greedy output is identical to no speculation alone, in
mixed batches, and on the decode plans of a quantized target; `disable_by_batch_size` keeps the
head caught up; bad heads are clear errors. (test_eagle.py runs the tests EAGLE-1 and EAGLE-3
heads share: chunking, preemption, prefix hits, TP 2, sampled distributions.)"""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers import cpu_kernels
from pagedllm.worker import decode_plan
from tests.spec_decode import test_eagle
from tests.spec_decode.test_eagle import GREEDY, PROMPTS, K, _ids, _read, _target_config, _write_head
from tests.utils import make_tiny_model


@pytest.fixture(scope="module")
def targets(tiny_llama, tiny_gemma3, tmp_path_factory) -> dict[str, str]:
    return {"llama": tiny_llama, "gemma3": tiny_gemma3,
            "qwen3": make_tiny_model(str(tmp_path_factory.mktemp("qwen3")), "qwen3")}


def _head_config(model: str, draft_vocab: int | None = None, aux: list[int] | None = None) -> dict:
    target = _target_config(model)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": target["hidden_size"], "intermediate_size": 96, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 1, "vocab_size": target["vocab_size"],
              "draft_vocab_size": draft_vocab or target["vocab_size"], "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
    if aux is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    return config


def _random_tensors(config: dict, seed: int, num_aux: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv, draft = config["num_attention_heads"], config["num_key_value_heads"], config["draft_vocab_size"]

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    p = "midlayer."
    t = {"fc.weight": rand(h, num_aux * h), "norm.weight": 1 + rand(h), "lm_head.weight": rand(draft, h, scale=1.0),
         p + "self_attn.q_proj.weight": rand(heads * hd, 2 * h), p + "self_attn.k_proj.weight": rand(kv * hd, 2 * h),
         p + "self_attn.v_proj.weight": rand(kv * hd, 2 * h), p + "self_attn.o_proj.weight": rand(h, heads * hd),
         p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
         p + "mlp.down_proj.weight": rand(h, inter)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[p + norm + ".weight"] = 1 + rand(h)
    vocab = config["vocab_size"]
    if draft < vocab:  # the draft vocabulary: every other target id from 3 on, as d2t offsets and the t2d mask
        ids = torch.arange(3, 3 + 2 * draft, 2) % vocab
        t["d2t"] = ids - torch.arange(draft)
        t["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        t["t2d"][ids] = True
    return t


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    angles = positions[:, None].float() * theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = (torch.cat((f, f), -1)[:, None] for f in (angles.cos(), angles.sin()))
    return x * cos + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * sin


def _head_rows(t: dict[str, torch.Tensor], config: dict, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The head's pre-norm output for a whole sequence (causal attention over it)."""
    p, hd = "midlayer.", config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    x = torch.cat((_rms(embeds, t[p + "input_layernorm.weight"]), _rms(hidden, t[p + "hidden_norm.weight"])), -1)
    n = len(x)
    pos = torch.arange(n)
    q = _rotate((x @ t[p + "self_attn.q_proj.weight"].T).view(n, heads, hd), pos, config["rope_theta"])
    k = _rotate((x @ t[p + "self_attn.k_proj.weight"].T).view(n, kv, hd), pos, config["rope_theta"])
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n, kv, hd)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * hd)
    x = hidden + o @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(x, t[p + "post_attention_layernorm.weight"])
    act = torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)
    return x + act @ t[p + "mlp.down_proj.weight"].T


def _reference_drafts(model: str, head: str, config: dict, aux: list[int], seq: list[int], n: int,
                      context: bool = False, probs: list[float] | None = None) -> list[int]:
    """transformers' hidden states entering the `aux` layers over `seq`, fused by fc, then the
    head's rows (token p + 1, fused hidden p), chained n times on its own pre-norm outputs. With
    `context`, `seq`'s tokens outside the draft vocabulary are candidates too, scored by the normed
    row against their embedding rows; `probs` gets each draft's softmax probability."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    t = {k: (v.float() if v.is_floating_point() else v) for k, v in _read(head).items()}
    embedding = target.get_input_embeddings().weight  # unscaled rows
    draft_ids = (torch.arange(len(t["d2t"])) + t["d2t"]).tolist() if "d2t" in t else []
    others = [tok for tok in dict.fromkeys(seq) if tok not in set(draft_ids)] if context else []
    with torch.no_grad():
        states = target.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        feats = torch.cat([states[i][0] for i in sorted(aux)], -1)[:-1] @ t["fc.weight"].T  # in layer order
        tokens, drafts = list(seq[1:]), []
        for _ in range(n):
            out = _head_rows(t, config, embedding[torch.tensor(tokens)], feats)
            normed = _rms(out[-1], t["norm.weight"])
            logits = normed @ t["lm_head.weight"].T
            best = int(logits.argmax())
            drafts.append(draft_ids[best] if draft_ids else best)
            scores = embedding[torch.tensor(others)] @ normed if others else torch.zeros(0)
            if others and scores.max() > logits[best]:
                drafts[-1] = others[int(scores.argmax())]
            if probs is not None:
                probs.append(float(torch.cat((logits, scores)).softmax(-1).max()))
            tokens.append(drafts[-1])
            feats = torch.cat((feats, out[-1:]))
    return drafts


def _engine(model: str, head: str | None = None, k: int = K, **kwargs) -> LLM:
    return test_eagle._engine(model, head, k, method="eagle3", **kwargs)


_spy = test_eagle._spy


@pytest.mark.parametrize("arch,aux,draft_vocab,layout", [("llama", None, None, "safetensors"),
                                                          ("qwen3", [0, 2], 40, "bin"),
                                                          ("gemma3", [1, 0, 2], 64, "safetensors")])
def test_drafts_equal_the_reference_and_greedy_is_unchanged(arch, aux, draft_vocab, layout, targets, tmp_path):
    """The llama head reads vLLM's default layers (2, L // 2, L - 3) = (2, 1, 0) of the 3-layer target."""
    model = targets[arch]
    config = _head_config(model, draft_vocab, aux)
    head = _write_head(str(tmp_path / "head"), config, _random_tensors(config, 3, len(aux or [2, 1, 0])), layout)
    reference = _ids(_engine(model), GREEDY)
    llm = _engine(model, head)
    seen = _spy(llm)
    assert _ids(llm, GREEDY) == reference  # all four prompts in one batch
    assert len(seen) > 20
    for seq, drafts in seen[:: max(1, len(seen) // 6)]:
        assert drafts == _reference_drafts(model, head, config, aux or [2, 1, 0], seq, len(drafts)), seq
    m = llm.get_metrics()
    assert m["pagedllm:spec_decode_num_draft_tokens"] > 0
    assert m["pagedllm:kv_cache_usage"] == 0.0


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="the decode plans run pagedllm's C kernels")
def test_decode_plans_keep_the_layers_inputs(tmp_path, monkeypatch):
    """An int8 target on the decode plans: the same drafts as its module path, step for step, and
    greedy output unchanged."""
    model = make_tiny_model(str(tmp_path / "gemma3_d32"), "gemma3", head_dim=32, query_pre_attn_scalar=32)
    config = _head_config(model)
    head = _write_head(str(tmp_path / "head"), config, _random_tensors(config, 7))
    plan_rows = []
    real_run = decode_plan.DecodePlan.run

    def run(self, *args):
        plan_rows.append(self.rows)
        return real_run(self, *args)

    monkeypatch.setattr(decode_plan.DecodePlan, "run", run)
    reference = _ids(_engine(model, quantization="int8"), GREEDY)
    plan_rows.clear()
    llm = _engine(model, head, quantization="int8")
    with_plans = _spy(llm)
    assert _ids(llm, GREEDY) == reference
    assert plan_rows and max(plan_rows) > 1  # verification rows ran on plans
    monkeypatch.setattr(decode_plan.DecodePlans, "takes", lambda self, md: False)
    llm = _engine(model, head, quantization="int8")
    without = _spy(llm)
    assert _ids(llm, GREEDY) == reference
    assert with_plans == without


def test_off_above_a_batch_size_then_on_with_the_head_caught_up(tiny_llama, tmp_path):
    """`disable_by_batch_size`: no drafts while 2 or more requests run; once one is left its drafts
    resume and equal the reference's, so the head caught up on the steps it did not draft."""
    config = _head_config(tiny_llama, draft_vocab=50)
    head = _write_head(str(tmp_path / "head"), config, _random_tensors(config, 8))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 30)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    reference = [o.outputs[0].token_ids for o in _engine(tiny_llama).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24, speculative_config={
        "method": "eagle3", "model": head, "num_speculative_tokens": K, "disable_by_batch_size": 2})
    seen = _spy(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    drafted = [(seq, d) for seq, d in seen if d]
    assert drafted and all(seq[: len(PROMPTS[2])] == PROMPTS[2] for seq, _ in drafted)  # the long one, alone
    assert len(drafted[0][0]) > len(PROMPTS[2]) + 9  # only after the others finished
    for seq, drafts in drafted[:: max(1, len(drafted) // 3)]:
        assert drafts == _reference_drafts(tiny_llama, head, config, [2, 1, 0], seq, len(drafts)), seq
    with pytest.raises(ValueError, match="disable_by_batch_size must be an integer >= 2"):
        LLM(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1})


def _constant_head(model: str, path: str, token: int) -> str:
    """A head whose output is zero at every row (fc, attention and MLP add nothing), so every draft
    logit ties; each draft id maps to `token`, so it always drafts `token`."""
    config = _head_config(model, draft_vocab=4)
    t = _random_tensors(config, 5)
    for name in ("fc.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
        t[name].zero_()
    t["d2t"] = token - torch.arange(4)  # every draft id maps to `token`
    t["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool)
    return _write_head(path, config, t)


def test_bad_heads_are_clear_errors(tiny_llama, tmp_path):
    config = _head_config(tiny_llama, draft_vocab=40)
    good = _random_tensors(config, 1)
    with pytest.raises(ValueError, match="target has 3"):
        _engine(tiny_llama, _write_head(str(tmp_path / "layers"), dict(config, eagle_config={
            "eagle_aux_hidden_state_layer_ids": [0, 5, 1]}), good))
    with pytest.raises(ValueError, match="needs 'd2t'"):
        _engine(tiny_llama, _write_head(str(tmp_path / "nod2t"), config,
                                        {k: v for k, v in good.items() if k != "d2t"}))
    with pytest.raises(ValueError, match="fc.weight is"):
        _engine(tiny_llama, _write_head(str(tmp_path / "fc"), config,
                                        dict(good, **{"fc.weight": good["fc.weight"][:, :-4]})))
    with pytest.raises(ValueError, match="missing tensors"):
        _engine(tiny_llama, _write_head(str(tmp_path / "partial"), config,
                                        {k: v for k, v in good.items() if "hidden_norm" not in k}))
    bad = dict(good, d2t=good["d2t"] + 10_000)
    with pytest.raises(ValueError, match="d2t does not map"):
        _engine(tiny_llama, _write_head(str(tmp_path / "d2t"), config, bad))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        _engine(tiny_llama, _write_head(str(tmp_path / "vocab"), dict(config, draft_vocab_size=10**6), good))
    os.makedirs(tmp_path / "raw", exist_ok=True)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "raw" / "model.safetensors"))
    with pytest.raises(ValueError, match="config.json"):
        _engine(tiny_llama, str(tmp_path / "raw"))


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="the int4 copies are pagedllm's kernel layout")
def test_a_quantized_targets_head_gets_int4_copies_where_the_kernels_take_them(tmp_path):
    """int4 where pagedllm's int4 kernels take the shape (128-input groups: qkv and o here),
    int8 where not (fc's 192 inputs, the 64-wide MLP and LM head); each float weight holds its
    copy's dequantized values, and greedy output stays that of no speculation."""
    from pagedllm.model_executor.layers.linear import Linear

    model = make_tiny_model(str(tmp_path / "gemma3_d32"), "gemma3", head_dim=32, query_pre_attn_scalar=32)
    config = _head_config(model)
    head_path = _write_head(str(tmp_path / "head"), config, _random_tensors(config, 7))
    llm = _engine(model, head_path, quantization="int8")
    head = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.eagle.head
    methods = {n: m.quant.method for n, m in head.named_modules() if isinstance(m, Linear)}
    assert methods["layer.self_attn.qkv_proj"] == methods["layer.self_attn.o_proj"] == "int4"
    assert methods["fc"] == methods["lm_head"] == "int8"
    x = torch.randn(2, head.layer.self_attn.qkv_proj.in_features)
    qkv = head.layer.self_attn.qkv_proj
    torch.testing.assert_close(qkv.quant(x), x @ qkv.weight.T, rtol=1e-3, atol=1e-3)
    assert _ids(llm, GREEDY) == _ids(_engine(model, quantization="int8"), GREEDY)


def test_the_proposers_embedding_rows_equal_the_lookup(tiny_llama, tmp_path, monkeypatch):
    """The proposer's cache of embedding rows gives the embedding's own rows in the pass's order,
    repeats included, and stays within its size (cleared when full); a pass longer than
    MAX_CACHED_PASS looks its rows up directly."""
    from pagedllm.spec_decode import eagle

    monkeypatch.setattr(eagle, "EMBED_CACHE_ROWS", 4)
    config = _head_config(tiny_llama)
    llm = _engine(tiny_llama, _write_head(str(tmp_path / "head"), config, _random_tensors(config, 5)))
    drafter = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.eagle
    drafter.embed_rows.clear()
    for tokens in ([5], [5, 7, 5], [1, 2, 3], [9, 9, 1], [4], list(range(eagle.MAX_CACHED_PASS + 3))):
        assert torch.equal(drafter._embed(tokens), drafter.embed(torch.tensor(tokens))), tokens
        assert 0 < len(drafter.embed_rows) <= 4
    assert set(drafter.embed_rows) == {4}  # [1, 2, 3] and [4] each found it too full, and cleared it


def test_context_tokens_outside_the_draft_vocabulary_are_drafted(tiny_gemma3, tmp_path):
    """`draft_context_tokens` (here from the head's config.json): each draft is the best of the
    head's draft-vocabulary logits and its normed row's dot products with the embedding rows of
    the context's other tokens, as the reference computes it, drafts outside the draft vocabulary
    among them; with a confidence threshold, chains end where the reference's running product of
    probabilities over both falls under it; greedy output is unchanged; finished requests are
    forgotten. The user's key turns it off; bad values and heads are clear errors."""
    from transformers import AutoModelForCausalLM

    model, aux, threshold = tiny_gemma3, [1, 0, 2], 0.2
    config = _head_config(model, draft_vocab=40, aux=aux)
    config["eagle_config"]["draft_context_tokens"] = True
    t = _random_tensors(config, 3)
    embedding = AutoModelForCausalLM.from_pretrained(model).get_input_embeddings().weight.detach()
    draft_ids = (torch.arange(40) + t["d2t"]).tolist()
    t["lm_head.weight"] = embedding[draft_ids].clone()  # as benchmarks/train_eagle.py starts a head
    t["norm.weight"] *= 8  # surer drafts (the same argmax), so that chains outlast the threshold
    head = _write_head(str(tmp_path / "head"), config, t)
    reference = _ids(_engine(model), GREEDY)
    for c in (0.0, threshold):
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": K, "draft_confidence_threshold": c}
        llm = LLM(model, kv_cache_memory=1 << 24, speculative_config=spec, dtype="float32")
        seen = _spy(llm)
        assert _ids(llm, GREEDY) == reference
        outside = [i for i, (_, drafts) in enumerate(seen) if set(drafts) - set(draft_ids)]
        assert outside, seen
        for seq, drafts in [seen[i] for i in outside[:3]] + seen[:: max(1, len(seen) // 4)]:
            probs: list[float] = []
            want = _reference_drafts(model, head, config, aux, seq, K, context=True, probs=probs)
            chance = torch.tensor(probs).cumprod(0)
            if c and (chance - c).abs().min() < 1e-4:
                continue  # too near the threshold for float rounding to decide
            assert drafts == want[: int((chance >= c).sum())], (seq, probs)
        requests = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.eagle.context.requests
        finished = set(requests)  # the workers hear of finished requests with the next step
        assert len(finished) == len(PROMPTS)
        _ids(llm, GREEDY, PROMPTS[:1])
        assert not finished & set(requests)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": K, "draft_context_tokens": False}
    llm = LLM(model, kv_cache_memory=1 << 24, speculative_config=spec, dtype="float32")
    assert llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.eagle.context is None
    with pytest.raises(ValueError, match="draft_context_tokens is for EAGLE-3"):
        LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "draft_context_tokens": True})
    with pytest.raises(ValueError, match="true or false"):
        LLM(model, speculative_config=spec | {"draft_context_tokens": "yes"})
    whole = _head_config(model, aux=aux)
    with pytest.raises(ValueError, match="drafts the whole vocabulary"):
        LLM(model, speculative_config=spec | {"model": _write_head(str(tmp_path / "whole"), whole,
                                                                   _random_tensors(whole, 1)),
                                              "draft_context_tokens": True})
