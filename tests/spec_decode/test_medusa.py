"""Medusa heads as drafters: greedy output identical to no speculation, the drafts taken from the
hidden row of each request's last sampled token (after a verification, its last accepted draft),
all drafts accepted when they are right, both checkpoint layouts, and clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.config import MedusaConfig
from pagedllm.spec_decode.medusa import load_medusa, read_medusa_config

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [30, 31, 32, 33, 30, 31], list(range(40, 70)), [12, 13, 12, 13, 12]]
K = 3


def _target_head(model: str) -> torch.Tensor:
    tensors = load_file(os.path.join(model, "model.safetensors"))
    return tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])


def _write_heads(path: str, blocks: list[tuple[torch.Tensor, torch.Tensor]], heads: list[torch.Tensor],
                 layout: str = "vllm") -> str:
    """One residual block per head (weight, bias) and its LM head, in vLLM's or FasterDecoding's layout."""
    os.makedirs(path, exist_ok=True)
    vocab, hidden = heads[0].shape
    if layout == "vllm":
        config = {"model_type": "medusa", "num_heads": len(heads), "num_hidden_layers": 1, "hidden_size": hidden,
                  "vocab_size": vocab}
        tensors = {f"blocks.{i}.layers.0.weight": w for i, (w, _) in enumerate(blocks)}
        tensors |= {f"blocks.{i}.layers.0.bias": b for i, (_, b) in enumerate(blocks)}
        tensors |= {f"lm_heads.{i}.weight": h for i, h in enumerate(heads)}
        name = "model.safetensors"
    else:
        config = {"medusa_num_heads": len(heads), "medusa_num_layers": 1, "base_model_name_or_path": "x"}
        tensors = {f"{i}.0.linear.weight": w for i, (w, _) in enumerate(blocks)}
        tensors |= {f"{i}.0.linear.bias": b for i, (_, b) in enumerate(blocks)}
        tensors |= {f"{i}.1.weight": h for i, h in enumerate(heads)}
        name = "medusa_lm_head.safetensors"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, os.path.join(path, name))
    return path


def _identity_heads(model: str, path: str, num_heads: int = K) -> str:
    """Zero blocks and the target's own LM head: every head guesses the target's own next token
    at the row it reads, so its drafts show which row that was."""
    head = _target_head(model)
    hidden = head.shape[1]
    zero = (torch.zeros(hidden, hidden), torch.zeros(hidden))
    return _write_heads(path, [zero] * num_heads, [head.clone() for _ in range(num_heads)])


def _engine(model: str, spec: dict | None = None) -> LLM:
    return LLM(model, dtype="float32", kv_cache_memory=1 << 24, speculative_config=spec)


def _ids(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_identical_and_drafts_from_the_last_sampled_row(arch, tiny_llama, tiny_gemma3, tmp_path):
    model = tiny_llama if arch == "llama" else tiny_gemma3
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = _ids(_engine(model), greedy)
    heads = _identity_heads(model, str(tmp_path / "heads"))
    llm = _engine(model, {"method": "medusa", "model": heads, "num_speculative_tokens": K})
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    proposed = runner._medusa_drafts
    seen = []

    def spy(reqs, hidden, cu_end, sampled):
        drafts = proposed(reqs, hidden, cu_end, sampled)
        seen.extend((new[-1], d) for new, d in zip(sampled, drafts) if new is not None)
        return drafts

    runner._medusa_drafts = spy
    assert _ids(llm, greedy) == reference
    assert seen and all(d == [last] * K for last, d in seen)  # read from the row `last` came from
    m = llm.get_metrics()
    assert m["pagedllm:spec_decode_num_accepted_tokens"] > 0  # rows after accepted drafts were read too
    assert m["pagedllm:kv_cache_usage"] == 0.0


def test_right_drafts_are_all_accepted(tiny_llama, tmp_path):
    """Heads that always guess token 77, and requests biased to always say it: every draft is
    accepted, each verification step yields K + 1 tokens, and the output equals no speculation."""
    head = _target_head(tiny_llama)
    vocab, hidden = head.shape
    push = torch.zeros(hidden)
    push[0] = 30.0  # SiLU(30) = 30: the block adds 30 to the first feature
    lm = torch.zeros(vocab, hidden)
    lm[77, 0] = 1.0
    heads = _write_heads(str(tmp_path / "const"), [(torch.zeros(hidden, hidden), push)] * K, [lm] * K)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logit_bias={77: 100.0})
    llm = _engine(tiny_llama, {"method": "medusa", "model": heads, "num_speculative_tokens": K})
    out = _ids(llm, params)
    assert out == [[77] * 17] * len(PROMPTS) == _ids(_engine(tiny_llama), params)
    m = llm.get_metrics()
    assert m["pagedllm:spec_decode_acceptance_rate"] > 0.95
    assert m["pagedllm:spec_decode_mean_acceptance_length"] > K
    per_pos = [m[f"pagedllm:spec_decode_accepted_at:{pos}"] for pos in range(K)]  # vLLM's ..._per_pos
    assert per_pos[0] >= per_pos[1] >= per_pos[2] > 0.95 * m["pagedllm:spec_decode_num_drafts"]
    assert sum(per_pos) == m["pagedllm:spec_decode_num_accepted_tokens"]


def test_both_layouts_load_the_same_heads(tmp_path):
    g = torch.Generator().manual_seed(0)
    blocks = [(torch.randn(8, 8, generator=g), torch.randn(8, generator=g)) for _ in range(2)]
    lms = [torch.randn(20, 8, generator=g) for _ in range(2)]
    paths = [_write_heads(str(tmp_path / layout), blocks, lms, layout) for layout in ("vllm", "fasterdecoding")]
    configs = [read_medusa_config(p) for p in paths]
    assert configs[0] == configs[1] == MedusaConfig(num_heads=2, num_layers=1, hidden_size=8, vocab_size=20)
    a, b = (load_medusa(p, c, torch.float32, torch.device("cpu")) for p, c in zip(paths, configs))
    x = torch.randn(3, 8, generator=g)
    torch.testing.assert_close(a(x, 2), b(x, 2))
    expected = torch.stack([lm @ (x + torch.nn.functional.silu(x @ w.T + bias)).T for (w, bias), lm
                            in zip(blocks, lms)]).transpose(1, 2)
    torch.testing.assert_close(a(x, 2), expected)


def test_bad_heads_are_clear_errors(tiny_llama, tmp_path):
    heads = _identity_heads(tiny_llama, str(tmp_path / "two"), num_heads=2)
    with pytest.raises(ValueError, match="more than the 2 Medusa heads"):
        _engine(tiny_llama, {"method": "medusa", "model": heads, "num_speculative_tokens": 3})
    small = _write_heads(str(tmp_path / "small"), [(torch.zeros(4, 4), torch.zeros(4))], [torch.zeros(9, 4)])
    with pytest.raises(ValueError, match="hidden size 4 and vocabulary 9"):
        _engine(tiny_llama, {"method": "medusa", "model": small, "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="needs 'model'"):
        _engine(tiny_llama, {"method": "medusa", "num_speculative_tokens": 1})
    broken = _write_heads(str(tmp_path / "broken"), [(torch.zeros(4, 4), torch.zeros(4))], [torch.zeros(9, 4)],
                          "fasterdecoding")
    with open(os.path.join(broken, "medusa_lm_head.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot be read"):
        _engine(tiny_llama, {"method": "medusa", "model": broken, "num_speculative_tokens": 1})
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="no config.json"):
        _engine(tiny_llama, {"method": "medusa", "model": str(tmp_path / "empty"), "num_speculative_tokens": 1})
