"""Each llama.cpp architecture the GGUF converter handles, end to end: a tiny random transformers
checkpoint is written as GGUF the way llama.cpp would (hf_to_gguf.py), converted back (config and
tokenizer; the weights as `iterate_weights` reads them from the GGUF), and checked against the
source (weights, config), against transformers' own GGUF loading, for its tokenizer and chat
template, and for greedy generation with pagedllm.

The source weights are drawn so the GGUF holds them exactly (matrices f16-representable, vectors
on a 1/256 grid so Gemma's stored 1 + w loses nothing, the embedding Q8_0-representable): the
round trip must then give back identical tensors, and pagedllm's generation must match
transformers' on the source checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedllm.transformers_utils.gguf_loader import convert_gguf  # noqa: E402
from pagedllm.transformers_utils.tokenizer import get_tokenizer  # noqa: E402
from tests.model_executor.loader.hf_to_gguf import Q8, write_gguf  # noqa: E402
from tests.model_executor.loader.test_gguf_loader import (  # noqa: E402
    CONVERTED_FILES,
    converted_state_dict,
    load_converted,
)
from tests.utils import assert_greedy_match, build_tokenizer, hf_greedy  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "phi3", "phi3_longrope", "gpt2", "starcoder2", "qwen3moe"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Config fields transformers' own GGUF loading leaves at the config class default (the converter
# fills them from the metadata): passed to it as overrides so that its weights can be compared.
TRANSFORMERS_GAPS = {
    "qwen3": {"head_dim": 32},
    "gemma3": {"query_pre_attn_scalar": 16},
    "gpt2": {"n_positions": 128},
    "starcoder2": {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
    "qwen3moe": {"moe_intermediate_size": 32},
}
# Config entries that only matter for training, or that no GGUF records.
_UNRECORDED = {
    "_name_or_path", "transformers_version", "initializer_range", "attention_dropout", "embedding_dropout",
    "residual_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "output_router_logits", "router_aux_loss_coef",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    "use_cache",
}


def _config(arch: str, vocab: int):
    from transformers import (
        Gemma3TextConfig,
        GPT2Config,
        LlamaConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
        Starcoder2Config,
    )

    ids = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    dense = dict(ids, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    if arch == "gpt2":
        return GPT2Config(**ids, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    if arch == "phi3_longrope":  # Phi-3 128k: llama.cpp keeps the factors as tensors
        factors = {f"{kind}_factor": [1.0 + (i + shift) / 8 for i in range(8)]
                   for kind, shift in [("long", 4), ("short", 0)]}
        return Phi3Config(**dict(dense, max_position_embeddings=512), original_max_position_embeddings=256,
                          rope_scaling={"rope_type": "longrope", **factors})
    cls, extra = {
        "llama": (LlamaConfig, dict(head_dim=16, tie_word_embeddings=False)),
        "qwen2": (Qwen2Config, dict(tie_word_embeddings=True)),  # q/k/v biases, tied head
        "qwen3": (Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),  # head_dim != hidden / heads
        "gemma3": (Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8)),
        "phi3": (Phi3Config, dict(sliding_window=2047)),
        "starcoder2": (Starcoder2Config, dict(rope_theta=100000.0)),  # biases, LayerNorm, tied head
        "qwen3moe": (Qwen3MoeConfig, dict(head_dim=32, moe_intermediate_size=32, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)),
    }[arch]
    return cls(**dense, **extra)


def _save_source(path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer(str(path))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch, len(tok)), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.1).half().float())
            else:
                p.copy_(torch.round(p * 256) / 256 + torch.randint(-32, 33, p.shape, generator=gen) / 256)
        embed = model.get_input_embeddings().weight
        embed.copy_(torch.from_numpy(gguf.dequantize(gguf.quantize(embed.numpy(), Q8), Q8)))
    model.save_pretrained(path)
    model.generation_config.save_pretrained(path)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Conversions (and LLM's) go to a temporary cache, not ~/.cache/pagedllm."""
    path = tmp_path_factory.mktemp("pagedllm_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory, cache_dir) -> SimpleNamespace:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    src = root / "hf"
    _save_source(src, arch)
    path = root / "gguf" / f"tiny-{arch}.gguf"
    path.parent.mkdir()
    types = write_gguf(src, path, CHAT_TEMPLATE)
    out = Path(convert_gguf(str(path)))
    assert out.parent == cache_dir / "gguf"
    hf_arch = json.loads((src / "config.json").read_text())["architectures"][0]
    return SimpleNamespace(arch=arch, src=src, gguf=path, out=out, types=types, hf_arch=hf_arch)


def test_weights_and_config_match_source(case) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    # The weights stay in the GGUF; the chat template is a file of its own.
    assert {p.name for p in case.out.iterdir()} == CONVERTED_FILES | {"chat_template.jinja"}
    want, got = load_file(str(case.src / "model.safetensors")), converted_state_dict(case.out)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    assert {"F16", "F32", "Q8_0"} <= set(case.types.values())

    src_cfg = AutoConfig.from_pretrained(case.src).to_dict()
    out_cfg = AutoConfig.from_pretrained(case.out).to_dict()
    assert out_cfg["architectures"] == [case.hf_arch]
    src_cfg.setdefault("unk_token_id", out_cfg.get("unk_token_id"))  # the GGUF names one for Gemma
    diff = {k: (out_cfg.get(k), src_cfg.get(k)) for k in set(src_cfg) | set(out_cfg)
            if k not in _UNRECORDED and out_cfg.get(k) != src_cfg.get(k)}
    assert not diff, diff  # (converted, source)


def test_transformers_gguf_loading_agrees(case) -> None:
    """transformers' own GGUF loader, given the fields its config mapping misses, builds the same model."""
    from transformers import AutoModelForCausalLM

    ours = load_converted(case.out)
    gaps = dict(TRANSFORMERS_GAPS.get(case.arch, {}))
    if case.arch == "phi3_longrope":  # nor does it read longrope's factors and original length back
        src = json.loads((case.src / "config.json").read_text())
        gaps.update({k: src[k] for k in ("rope_parameters", "original_max_position_embeddings")})
    theirs = AutoModelForCausalLM.from_pretrained(
        case.gguf.parent, gguf_file=case.gguf.name, dtype=torch.float32, **gaps
    ).eval()
    assert type(theirs) is type(ours)
    mine, ref = ours.state_dict(), theirs.state_dict()
    assert sorted(mine) == sorted(ref)
    for name, tensor in ref.items():
        torch.testing.assert_close(mine[name], tensor, rtol=0, atol=0, msg=name)
    ids = torch.tensor([[3, 70, 200, 5, 9, 41, 17]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits)


def test_tokenizer_and_chat_template(case) -> None:
    from transformers import AutoTokenizer

    tok, src = get_tokenizer(str(case.out)), AutoTokenizer.from_pretrained(case.src)
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|user|>Hi!</s><|assistant|>"
    )
    # A byte-level vocabulary is this test's own in a Gemma file: real ones are sentencepiece, as
    # GemmaTokenizer assumes. No digits: Qwen2Tokenizer splits them one by one, as Qwen's do.
    for text in ["The quick brown fox", " café, naïve ✓", "Hello</s>\n\n  x"] if case.arch != "gemma3" else []:
        assert tok(text, add_special_tokens=False).input_ids == src(text, add_special_tokens=False).input_ids
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    gen = json.loads((case.out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def test_generation_matches_transformers(case) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.models.registry import ModelRegistry

    if not ModelRegistry.is_supported(case.hf_arch):
        pytest.skip(f"{case.hf_arch} is not a pagedllm model on this branch")
    prompts = [[5, 80, 33, 140, 7, 260, 61, 99, 12, 300, 45, 8], [17, 3, 200]]
    # LongRoPE: pagedllm takes one factor set per engine (the long one when max_model_len is past the
    # original length); transformers picks by each sequence's length, the short one for these prompts.
    limit = {"max_model_len": 256} if case.arch == "phi3_longrope" else {}
    llm = LLM(str(case.gguf), dtype="float32", kv_cache_memory=1 << 24, **limit)
    assert llm.get_tokenizer().chat_template == CHAT_TEMPLATE
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_match([list(o.outputs[0].token_ids) for o in outs], hf_greedy(str(case.src), prompts, 8))
    del llm


def test_quantized_tensor_survives(tmp_path: Path) -> None:
    """A Q8_0 matrix that llama.cpp also transposes (GPT-2) or row-permutes (llama): the fix-up
    applies to the dequantized values, within Q8_0's rounding of the source."""
    from safetensors.torch import load_file

    for arch, gguf_name, hf_name in [
        ("gpt2", "blk.0.attn_qkv.weight", "transformer.h.0.attn.c_attn.weight"),
        ("llama", "blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight"),
    ]:
        src = tmp_path / arch
        _save_source(src, arch)
        path = tmp_path / f"{arch}.gguf"
        assert write_gguf(src, path, q8=(gguf_name,))[gguf_name] == "Q8_0"
        out = convert_gguf(str(path), cache_dir=str(tmp_path / "cache"))
        want, got = load_file(str(src / "model.safetensors"))[hf_name], converted_state_dict(out)[hf_name]
        err = (got - want).abs().max().item()
        assert 0 < err <= want.abs().max().item() / 127, (arch, err)


def test_fused_gate_up_experts(tmp_path: Path) -> None:
    """llama.cpp can store a MoE layer's gate and up stacks as one ffn_gate_up_exps tensor."""
    from safetensors.torch import load_file

    _save_source(tmp_path / "hf", "qwen3moe")
    types = write_gguf(tmp_path / "hf", tmp_path / "fused.gguf", fuse_gate_up=True)
    assert "blk.0.ffn_gate_up_exps.weight" in types and "blk.0.ffn_gate_exps.weight" not in types
    out = convert_gguf(str(tmp_path / "fused.gguf"), cache_dir=str(tmp_path / "cache"))
    want, got = load_file(str(tmp_path / "hf" / "model.safetensors")), converted_state_dict(out)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
