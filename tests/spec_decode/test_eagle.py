"""EAGLE heads as drafters, in the Hub layout: each draft equals a transformers reference of the
head over the target's own hidden states (Llama, Qwen3 and Gemma 3 targets); greedy output is
identical to no speculation alone and in mixed batches; bad heads are clear errors. For EAGLE
and EAGLE-3 heads alike (the proposer they share): through chunked prompts, preemptions and
prefix-cache hits greedy output is unchanged; a head whose drafts are right has them all
accepted, also at TP 2; sampled output keeps the target's distribution."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from tests.spec_decode.test_spec_decode import _chi_square_pvalue, _exact_marginals, _second_and_third_counts
from tests.utils import build_tokenizer, make_tiny_model, save_tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [30, 31, 32, 33, 30, 31], list(range(40, 70)), [12, 13, 12, 13, 12]]
K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def targets(tiny_llama, tiny_gemma3, tmp_path_factory) -> dict[str, str]:
    return {"llama": tiny_llama, "gemma3": tiny_gemma3,
            "qwen3": make_tiny_model(str(tmp_path_factory.mktemp("qwen3")), "qwen3")}


def _target_config(model: str) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    return config.get("text_config", config)


def _head_config(model: str, layers: int = 1) -> dict:
    target = _target_config(model)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": target["hidden_size"],
            "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": target["hidden_size"] // 4, "num_hidden_layers": layers, "vocab_size": target["vocab_size"],
            "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "hidden_act": "silu"}


def _random_tensors(config: dict, seed: int, fc_bias: bool, own_embedding: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    t = {"fc.weight": rand(h, 2 * h)}
    if fc_bias:
        t["fc.bias"] = rand(h)
    if own_embedding:
        t["embed_tokens.weight"] = rand(config["vocab_size"], h, scale=1.0)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        t |= {p + "self_attn.q_proj.weight": rand(heads * hd, h), p + "self_attn.k_proj.weight": rand(kv * hd, h),
              p + "self_attn.v_proj.weight": rand(kv * hd, h), p + "self_attn.o_proj.weight": rand(h, heads * hd),
              p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
              p + "mlp.down_proj.weight": rand(h, inter), p + "post_attention_layernorm.weight": 1 + rand(h)}
        if i:
            t[p + "input_layernorm.weight"] = 1 + rand(h)
    return t


def _write_head(path: str, config: dict, tensors: dict[str, torch.Tensor], layout: str = "safetensors") -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = {k: v.clone().contiguous() for k, v in tensors.items()}
    if layout == "safetensors":
        save_file(tensors, os.path.join(path, "model.safetensors"))
    else:
        torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
    return path


def _engine(model: str, head: str | None = None, k: int = K, method: str = "eagle", **kwargs) -> LLM:
    spec = {"method": method, "model": head, "num_speculative_tokens": k} if head else None
    kwargs.setdefault("dtype", "float32")
    return LLM(model, kv_cache_memory=1 << 24, speculative_config=spec, **kwargs)


def _random_head(method: str, model: str, path: str, seed: int) -> str:
    """A random head of `method`'s layout for `model`, written to `path`."""
    if method == "eagle":
        config = _head_config(model)
        return _write_head(path, config, _random_tensors(config, seed, False, False))
    from tests.spec_decode import test_eagle3  # (it imports this module's helpers)

    config = test_eagle3._head_config(model, draft_vocab=50)
    return _write_head(path, config, test_eagle3._random_tensors(config, seed))


def _constant_head_of(method: str, model: str, path: str, token: int) -> str:
    if method == "eagle":
        return _constant_head(model, path, token)
    from tests.spec_decode import test_eagle3

    return test_eagle3._constant_head(model, path, token)


def _ids(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _reference_drafts(model: str, head: str, seq: list[int], n: int, probs: list[float] | None = None) -> list[int]:
    """transformers: the target's final hidden states over `seq`, then the head's rows (token p + 1,
    hidden p) for every position, chained n times on its own outputs (each draft's softmax
    probability appended to `probs` where given)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaModel

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    config = LlamaConfig.from_pretrained(head)
    layers = LlamaModel(config).eval()
    layers.layers[0].input_layernorm = torch.nn.Identity()
    layers.norm = torch.nn.Identity()
    tensors = {k: v.float() for k, v in _read(head).items()}
    layers.load_state_dict({k: v for k, v in tensors.items() if k.startswith("layers.")}, strict=False)
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias="fc.bias" in tensors)
    fc.load_state_dict({k.removeprefix("fc."): v for k, v in tensors.items() if k.startswith("fc.")})
    embedding = tensors.get("embed_tokens.weight", target.get_input_embeddings().weight)  # unscaled rows
    with torch.no_grad():
        feats = target.model(torch.tensor([seq])).last_hidden_state[0, :-1]
        tokens = list(seq[1:])
        drafts = []
        for _ in range(n):
            x = fc(torch.cat((embedding[torch.tensor(tokens)], feats), dim=-1))
            out = layers(inputs_embeds=x[None], position_ids=torch.arange(len(tokens))[None]).last_hidden_state[0]
            logits = target.lm_head(out[-1])
            drafts.append(int(logits.argmax()))
            if probs is not None:
                probs.append(float(logits.softmax(-1).max()))
            tokens.append(drafts[-1])
            feats = torch.cat((feats, out[-1:]))
    return drafts


def _spy(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(known tokens, drafts) of every proposal the engine's EAGLE proposer (any of its methods)
    makes from now on."""
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    propose, seen = runner.eagle.propose, []

    def spy(reqs, new_tokens, feats, cu_end, **kw):
        drafts = propose(reqs, new_tokens, feats, cu_end, **kw)
        seen.extend((r.state.token_slice(0, r.end) + list(new), d)
                    for r, new, d in zip(reqs, new_tokens, drafts) if d is not None)
        return drafts

    runner.eagle.propose = spy
    return seen


def _read(head: str) -> dict[str, torch.Tensor]:
    file = os.path.join(head, "model.safetensors")
    return load_file(file) if os.path.exists(file) else torch.load(os.path.join(head, "pytorch_model.bin"))


@pytest.mark.parametrize("arch,layout", [("llama", "safetensors"), ("qwen3", "bin"), ("gemma3", "safetensors")])
def test_drafts_equal_the_reference_and_greedy_is_unchanged(arch, layout, targets, tmp_path):
    model = targets[arch]
    config = _head_config(model, layers=1 if arch != "qwen3" else 2)
    head = _write_head(str(tmp_path / "head"), config,
                       _random_tensors(config, seed=3, fc_bias=layout == "bin", own_embedding=layout == "bin"),
                       layout)
    reference = _ids(_engine(model), GREEDY)
    llm = _engine(model, head)
    seen = _spy(llm)
    assert _ids(llm, GREEDY) == reference  # all four prompts in one batch
    assert len(seen) > 20
    for seq, drafts in seen[:: max(1, len(seen) // 8)]:
        assert drafts == _reference_drafts(model, head, seq, len(drafts)), seq
    m = llm.get_metrics()
    assert m["pagedllm:spec_decode_num_draft_tokens"] > 0
    assert m["pagedllm:kv_cache_usage"] == 0.0


def _constant_head(model: str, path: str, token: int) -> str:
    """A head whose output is the same vector at every row (fc gives its bias; attention and MLP
    add nothing), chosen so the target's LM head makes `token` its argmax: it always drafts `token`."""
    config = _head_config(model)
    tensors = _random_tensors(config, seed=5, fc_bias=True, own_embedding=False)
    weights = load_file(os.path.join(model, "model.safetensors"))
    lm = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    target = torch.zeros(lm.shape[0])
    target[token] = 50.0
    bias = torch.linalg.pinv(lm) @ target  # logits as near as the head's span allows to 50 at `token`, 0 elsewhere
    assert int((lm @ bias).argmax()) == token
    tensors["fc.weight"].zero_()
    tensors["fc.bias"] = bias
    tensors["layers.0.self_attn.o_proj.weight"].zero_()
    tensors["layers.0.mlp.down_proj.weight"].zero_()
    return _write_head(path, config, tensors)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_right_drafts_are_all_accepted(tp, method, tiny_llama, tmp_path):
    """Also across two tensor-parallel worker processes, whose ranks each hold half the head's layer."""
    token = 77
    head = _constant_head_of(method, tiny_llama, str(tmp_path / "const"), token)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logit_bias={token: 100.0})
    llm = _engine(tiny_llama, head, method=method, tensor_parallel_size=tp)
    assert _ids(llm, params) == [[token] * 17] * len(PROMPTS) == _ids(_engine(tiny_llama), params)
    m = llm.get_metrics()
    assert m["pagedllm:spec_decode_acceptance_rate"] > 0.95
    assert m["pagedllm:spec_decode_mean_acceptance_length"] > K


def test_a_confidence_threshold_ends_chains_where_the_heads_chance_falls(tiny_llama, tmp_path):
    """With `draft_confidence_threshold` each chain is the reference's drafts up to the first whose
    running product of the head's probabilities falls under the threshold (none at all where the
    first does), and greedy output is unchanged."""
    model, threshold = tiny_llama, 0.45
    head = _random_head("eagle", model, str(tmp_path / "head"), seed=3)
    reference = _ids(_engine(model), GREEDY)
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": K, "draft_confidence_threshold": threshold}
    llm = LLM(model, kv_cache_memory=1 << 24, speculative_config=spec, dtype="float32")
    seen = _spy(llm)
    assert _ids(llm, GREEDY) == reference
    lengths = {len(d) for _, d in seen}
    assert 0 in lengths and K in lengths and len(lengths) >= 3, lengths  # chains of every length the head gives
    for seq, drafts in seen[:: max(1, len(seen) // 10)]:
        probs: list[float] = []
        want = _reference_drafts(model, head, seq, K, probs)
        chance = torch.tensor(probs).cumprod(0)
        if (chance - threshold).abs().min() < 1e-4:
            continue  # too near the threshold for float rounding to decide
        assert drafts == want[: int((chance >= threshold).sum())], (seq, probs)
    with pytest.raises(ValueError, match="draft_confidence_threshold"):
        LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                       "draft_confidence_threshold": 0.5})
    with pytest.raises(ValueError, match="draft_confidence_threshold"):
        LLM(model, speculative_config=spec | {"draft_confidence_threshold": 1.5})


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_chunking_preemption_and_prefix_cache_keep_greedy(method, tiny_llama, tmp_path):
    """A token budget of 10 cuts prompts and verifications into pieces, 6 blocks of 16 force
    preemptions, the repeated prompts hit the prefix cache."""
    head = _random_head(method, tiny_llama, str(tmp_path / "head"), 4)
    reference = _ids(_engine(tiny_llama), GREEDY)
    llm = LLM(tiny_llama, dtype="float32", max_num_batched_tokens=10, num_gpu_blocks_override=6, max_model_len=64,
              speculative_config={"method": method, "model": head, "num_speculative_tokens": K})
    assert _ids(llm, GREEDY, PROMPTS + PROMPTS) == reference + reference
    m = llm.get_metrics()
    assert m["pagedllm:num_preemptions"] > 0 and m["pagedllm:prefix_cache_hits"] > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_sampled_tokens_follow_the_target_distribution(method, tiny_llama, tmp_path):
    """A head that always drafts the likeliest 2nd token: the target's own marginals for the 2nd
    and 3rd tokens, with both verification paths (accepted, resampled) taken."""
    assert_keeps_the_target_distribution(tiny_llama, lambda token: _engine(
        tiny_llama, _constant_head_of(method, tiny_llama, str(tmp_path / "const"), token), k=2, method=method))


def assert_keeps_the_target_distribution(model: str, drafting: Callable[[int], LLM]) -> None:
    """`drafting(token)`: an engine on `model` whose drafter always proposes `token`. Given the
    likeliest 2nd token of a prompt, its sampled 2nd and 3rd tokens follow the target's own
    marginals (chi-square), with both verification paths taken."""
    prompt = [5, 6, 7, 8, 9]
    temperature, top_k = 1.5, 4
    second, third = _exact_marginals(model, prompt, temperature, top_k)
    llm = drafting(max(second, key=second.get))
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True, seed=s)
              for s in range(1500)]
    counts2, counts3 = _second_and_third_counts(llm, prompt, params)
    assert 0.05 < llm.get_metrics()["pagedllm:spec_decode_acceptance_rate"] < 0.95
    assert _chi_square_pvalue(counts2, second) > 1e-3
    assert _chi_square_pvalue(counts3, third) > 1e-3


def test_bad_heads_are_clear_errors(tiny_llama, tmp_path):
    config = _head_config(tiny_llama)
    wrong = dict(config, hidden_size=config["hidden_size"] * 2)
    with pytest.raises(ValueError, match="hidden size"):
        _engine(tiny_llama, _write_head(str(tmp_path / "wide"), wrong, {}))
    tensors = _random_tensors(config, 1, False, False)
    del tensors["layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="EAGLE head"):
        _engine(tiny_llama, _write_head(str(tmp_path / "partial"), config, tensors))
    os.makedirs(tmp_path / "empty", exist_ok=True)
    with open(tmp_path / "empty" / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="none of"):
        _engine(tiny_llama, str(tmp_path / "empty"))
    from transformers import GPT2Config

    gpt2 = str(tmp_path / "gpt2")  # a target with no model.embed_tokens to lend the head
    build_tokenizer(gpt2)
    save_tiny_model(gpt2, GPT2Config(vocab_size=config["vocab_size"], n_embd=config["hidden_size"], n_layer=1, n_head=4,
                                     n_positions=512, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    with pytest.raises(ValueError, match="no model.embed_tokens"):
        _engine(gpt2, _write_head(str(tmp_path / "for_gpt2"), config, _random_tensors(config, 1, False, False)))
    with pytest.raises(ValueError, match="pipeline_parallel_size=1"):
        LLM(tiny_llama, pipeline_parallel_size=2,
            speculative_config={"method": "eagle", "model": str(tmp_path / "empty"), "num_speculative_tokens": 2})
