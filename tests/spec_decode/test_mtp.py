"""MTP drafts (`method` "mtp") from the multi-token-prediction layer a MiMo checkpoint carries
beside its own (`model.mtp_layers.0.*`): the target loads as Qwen2 without them; each draft equals
a transformers reference of the layer over the target's own hidden states; greedy output is
unchanged alone, in mixed batches, through chunked prompts, preemptions and prefix-cache hits;
right drafts are all accepted (also at TP 2); sampled output keeps the target's distribution;
what cannot run is a clear error at start."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from tests.spec_decode.test_eagle import GREEDY, PROMPTS, K, _ids, _spy, assert_keeps_the_target_distribution
from tests.utils import make_tiny_model

PREFIX = "model.mtp_layers.0."


def _mtp_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP layer in MiMo's names for a Qwen2 config (q/k/v with biases)."""
    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hd

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    parts = {"token_layernorm.weight": 1 + rand(h), "hidden_layernorm.weight": 1 + rand(h),
             "input_proj.weight": rand(h, 2 * h), "final_layernorm.weight": 1 + rand(h),
             "input_layernorm.weight": 1 + rand(h), "post_attention_layernorm.weight": 1 + rand(h),
             "self_attn.q_proj.weight": rand(h, h), "self_attn.q_proj.bias": rand(h),
             "self_attn.k_proj.weight": rand(kv, h), "self_attn.k_proj.bias": rand(kv),
             "self_attn.v_proj.weight": rand(kv, h), "self_attn.v_proj.bias": rand(kv),
             "self_attn.o_proj.weight": rand(h, h), "mlp.gate_proj.weight": rand(inter, h),
             "mlp.up_proj.weight": rand(inter, h), "mlp.down_proj.weight": rand(h, inter)}
    return {PREFIX + k: v for k, v in parts.items()}


def _write_mimo(qwen2: str, path: str, mtp: dict[str, torch.Tensor], layers: int = 1) -> str:
    """`qwen2` as a MiMo checkpoint (its config as the Hub's MiMo repos write it) with `mtp`."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(qwen2):
        if name not in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(qwen2, name), path)
    save_file(load_file(os.path.join(qwen2, "model.safetensors")) | mtp, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(qwen2, "config.json")) as f:
        config = json.load(f)
    config |= {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "num_nextn_predict_layers": layers,
               "auto_map": {"AutoConfig": "configuration_mimo.MiMoConfig",
                            "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _config(model: str) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2")), "qwen2")


@pytest.fixture(scope="module")
def mimo(qwen2, tmp_path_factory) -> str:
    return _write_mimo(qwen2, str(tmp_path_factory.mktemp("mimo")), _mtp_tensors(_config(qwen2), seed=7))


def _constant_mtp(qwen2: str, path: str, token: int) -> str:
    """An MTP layer whose output is the same vector at every row, chosen so the target's LM head
    makes `token` its argmax: its input is zero (input_proj 0), so attention gives o_proj(v's
    bias) = ones, the MLP adds nothing, and final_layernorm's weight is then the output itself."""
    config = _config(qwen2)
    h = config["hidden_size"]
    t = _mtp_tensors(config, seed=5)
    lm = load_file(os.path.join(qwen2, "model.safetensors"))["lm_head.weight"]
    goal = torch.zeros(lm.shape[0])
    goal[token] = 50.0
    out = torch.linalg.pinv(lm) @ goal  # logits as near as the LM head's span allows to 50 at `token`, 0 elsewhere
    assert int((lm @ out).argmax()) == token
    t[PREFIX + "input_proj.weight"].zero_()
    t[PREFIX + "self_attn.v_proj.weight"].zero_()
    t[PREFIX + "self_attn.v_proj.bias"].fill_(1.0)
    t[PREFIX + "self_attn.o_proj.weight"] = torch.eye(h)
    t[PREFIX + "mlp.down_proj.weight"].zero_()
    t[PREFIX + "final_layernorm.weight"] = out
    return _write_mimo(qwen2, path, t)


def _engine(model: str, k: int | None = K, **kwargs) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    return LLM(model, dtype="float32", kv_cache_memory=1 << 24, speculative_config=spec, **kwargs)


def _reference_drafts(mimo: str, seq: list[int], n: int) -> list[int]:
    """transformers: the target's final hidden states over `seq`; then the MTP layer's rows
    (hidden p, token p + 1 at position p, position 0's embedding zeroed), chained n times on its
    own outputs, through the target's LM head."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2Model
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    config = {k: v for k, v in _config(mimo).items() if k not in ("model_type", "auto_map", "architectures")}
    qwen2 = Qwen2Config(**config)
    target = AutoModelForCausalLM.from_config(qwen2, dtype=torch.float32).eval()
    weights = load_file(os.path.join(mimo, "model.safetensors"))
    target.load_state_dict({k: v for k, v in weights.items() if not k.startswith(PREFIX)})
    mtp = {k.removeprefix(PREFIX): v for k, v in weights.items() if k.startswith(PREFIX)}
    block = Qwen2Model(Qwen2Config(**(config | {"num_hidden_layers": 1, "layer_types": ["full_attention"]}))).eval()
    block.norm = torch.nn.Identity()
    block.load_state_dict({"layers.0." + k: v for k, v in mtp.items()
                           if k.startswith(("self_attn", "mlp", "input_", "post_"))}, strict=False)
    norms = {}
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        norms[name] = Qwen2RMSNorm(qwen2.hidden_size, qwen2.rms_norm_eps)
        norms[name].weight.data.copy_(mtp[name + ".weight"])
    with torch.no_grad():
        feats = target.model(torch.tensor([seq])).last_hidden_state[0, :-1]
        tokens = list(seq[1:])
        drafts = []
        for _ in range(n):
            embeds = target.model.embed_tokens.weight[torch.tensor(tokens)].clone()
            embeds[0] = 0.0  # position 0
            x = torch.cat((norms["hidden_layernorm"](feats), norms["token_layernorm"](embeds)), dim=-1)
            x = x @ mtp["input_proj.weight"].T
            out = block(inputs_embeds=x[None], position_ids=torch.arange(len(tokens))[None]).last_hidden_state[0]
            out = norms["final_layernorm"](out)
            drafts.append(int(target.lm_head(out[-1]).argmax()))
            tokens.append(drafts[-1])
            feats = torch.cat((feats, out[-1:]))
    return drafts


def test_drafts_equal_the_reference_and_greedy_is_unchanged(mimo, qwen2):
    reference = _ids(_engine(qwen2, None), GREEDY)
    assert _ids(_engine(mimo, None), GREEDY) == reference  # MiMo without its MTP layers is its Qwen2
    llm = _engine(mimo)
    seen = _spy(llm)
    assert _ids(llm, GREEDY) == reference  # all four prompts in one batch
    assert len(seen) > 20
    for seq, drafts in seen[:: max(1, len(seen) // 8)]:
        assert drafts == _reference_drafts(mimo, seq, len(drafts)), seq
    m = llm.get_metrics()
    assert m["pagedllm:spec_decode_num_draft_tokens"] > 0
    assert m["pagedllm:kv_cache_usage"] == 0.0


def test_chunking_preemption_and_prefix_cache_keep_greedy(mimo, qwen2):
    reference = _ids(_engine(qwen2, None), GREEDY)
    llm = _engine(mimo, max_num_batched_tokens=10, num_gpu_blocks_override=6, max_model_len=64)
    assert _ids(llm, GREEDY, PROMPTS + PROMPTS) == reference + reference
    m = llm.get_metrics()
    assert m["pagedllm:num_preemptions"] > 0 and m["pagedllm:prefix_cache_hits"] > 0


def test_right_drafts_are_all_accepted_at_tp2(qwen2, tmp_path):
    """Two tensor-parallel ranks each hold half the MTP layer's attention and MLP."""
    token = 77
    model = _constant_mtp(qwen2, str(tmp_path / "const"), token)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logit_bias={token: 100.0})
    llm = _engine(model, tensor_parallel_size=2)
    assert _ids(llm, params) == [[token] * 17] * len(PROMPTS)
    m = llm.get_metrics()
    assert m["pagedllm:spec_decode_acceptance_rate"] > 0.95
    assert m["pagedllm:spec_decode_mean_acceptance_length"] > K


def test_sampled_tokens_follow_the_target_distribution(qwen2, tmp_path):
    """Drafts of the likeliest 2nd token: the target's own marginals for the 2nd and 3rd tokens,
    with both verification paths (accepted, resampled) taken."""
    assert_keeps_the_target_distribution(qwen2, lambda token: _engine(
        _constant_mtp(qwen2, str(tmp_path / "const"), token), k=2))


def test_what_cannot_run_is_a_clear_error(mimo, qwen2, tmp_path):
    with pytest.raises(ValueError, match="Qwen2ForCausalLM is not one"):
        _engine(qwen2)
    with pytest.raises(ValueError, match="has no MTP layers"):
        _engine(_write_mimo(qwen2, str(tmp_path / "none"), {}, layers=0))
    with pytest.raises(ValueError, match=r"no model\.mtp_layers\.0\.\* tensors"):
        _engine(_write_mimo(qwen2, str(tmp_path / "missing"), {}))
    with pytest.raises(ValueError, match="'model' must be the target"):
        LLM(mimo, speculative_config={"method": "mtp", "model": qwen2, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pipeline_parallel_size=1"):
        LLM(mimo, pipeline_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
