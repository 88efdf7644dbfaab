"""GGUF files run on their own blocks (`--quantization gguf`, the default for a quantized GGUF on
CPU): every supported block type, mixed within one layer's q/k/v and gate/up as llama.cpp mixes
them, through the engine against transformers on the same file's dequantized weights. Greedy
tokens agree up to near-ties: the kernels quantize activations to int8 per 32 values (as
llama.cpp does), so logits differ from the float reference by ~1e-3 relative, and a near-tie
may flip. The layers hold no float copy of a quantized weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedllm.model_executor.layers import gguf_ops  # noqa: E402
from pagedllm.model_executor.layers.gguf_linear import GGUFLinear, GGUFRankedHead  # noqa: E402
from pagedllm.transformers_utils.gguf_loader import convert_gguf  # noqa: E402
from tests.model_executor.loader.hf_to_gguf import write_gguf  # noqa: E402
from tests.model_executor.loader.test_gguf_loader import load_converted  # noqa: E402
from tests.utils import assert_greedy_match, build_tokenizer  # noqa: E402

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
_MATRICES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 200, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def _config(arch: str, vocab: int):
    from transformers import Gemma3TextConfig, LlamaConfig

    # k = 256 everywhere: the K-quants' 256-value blocks
    dims = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=256,
                intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, max_position_embeddings=512)
    if arch == "llama":  # q/k rows reordered by llama.cpp; an untied head
        return LlamaConfig(**dims, tie_word_embeddings=False)
    return Gemma3TextConfig(**dims, query_pre_attn_scalar=64, sliding_window=8)  # tied head, decode plans


def _types(arch: str, shift: int) -> dict[str, T]:
    """Every type on some matrix, neighbours of one fused projection in different types."""
    names = [f"blk.{b}.{m}.weight" for b in range(2) for m in _MATRICES] + ["token_embd.weight"]
    if arch == "llama":
        names.append("output.weight")
    return {name: TYPES[(i + shift) % len(TYPES)] for i, name in enumerate(names)}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def case(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    src = root / "hf"
    tok = build_tokenizer(str(src))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch, len(tok)), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    model.save_pretrained(src)
    path = root / f"{arch}.gguf"
    types = write_gguf(src, path, types=_types(arch, 0 if arch == "llama" else 3))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(root / "cache"))
        out = convert_gguf(str(path))
        yield path, Path(out), types


def _reference(out: Path, max_tokens: int) -> list[dict]:
    model = load_converted(out)
    results = []
    for ids in PROMPTS:
        seq = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        results.append({"tokens": seq.sequences[0, len(ids):].tolist(),
                        "logprobs": [torch.log_softmax(s[0].float(), -1) for s in seq.logits]})
    return results


def test_every_type_runs_natively_and_matches_the_dequantized_reference(case, monkeypatch) -> None:
    from pagedllm import LLM, SamplingParams

    path, out, types = case
    assert set(TYPES) <= {T[name] for name in types.values()}
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(out.parent.parent))
    llm = LLM(str(path), dtype="float32", quantization="gguf", max_model_len=128, kv_cache_memory=1 << 26)
    try:
        model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
        linears = [m for m in model.modules() if isinstance(getattr(m, "gguf", None), (GGUFLinear, GGUFRankedHead))]
        blocks = {id(getattr(m.gguf, "blocks", m.gguf)) for m in linears}
        # 7 projections (as 4 fused layers) a layer, the embedding, the head (Gemma's is the embedding)
        assert len(blocks) == 2 * 4 + 2 - (path.stem == "gemma3")
        assert isinstance(model.lm_head.gguf, GGUFRankedHead)  # batch-1 steps rank on a 4-bit copy
        # On AVX2 / AVX-512 the layers' Q4_K / Q6_K / Q5_0 / Q4_0 blocks run repacked 8 rows at a time; the
        # second start below keeps the file's layout and must decode the same tokens.
        segments = [s for m in linears if isinstance(m.gguf, GGUFLinear) for s in m.gguf.segments]
        repacked = {T(s.qtype) for s in segments if s.repacked}
        assert repacked == ({T.Q4_K, T.Q6_K, T.Q5_0, T.Q4_0} if gguf_ops.repack_pays() else set())
        for m in linears:  # no float copy: the layers run the file's blocks
            if hasattr(m, "weight"):
                assert m.weight.numel() == 0
        params = SamplingParams(max_tokens=12, temperature=0)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    finally:
        llm.llm_engine.shutdown()
    assert_greedy_match(got, _reference(out, 12), tol=0.05)
    # The head's ranking copies were cached: a second start reads them, and decodes the same
    # with the layers in the file's own layout.
    cached = sorted((out.parent.parent / "quantized").glob("*.safetensors"))
    assert len(cached) == 1, cached
    monkeypatch.setenv("PAGEDLLM_GGUF_REPACK", "0")
    llm = LLM(str(path), dtype="float32", quantization="gguf", max_model_len=128, kv_cache_memory=1 << 26)
    try:
        again = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        # A sampled token's logprob is the file's: normalized over the blocks' logits for the
        # whole vocabulary (rows asking for logprobs skip the ranking copies).
        first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                             SamplingParams(max_tokens=1, temperature=0, logprobs=5, prompt_logprobs=5))
    finally:
        llm.llm_engine.shutdown()
    assert again == got
    reference = _reference(out, 1)
    worst = 0.0
    for o, ref in zip(first, reference):
        token = o.outputs[0].token_ids[0]
        worst = max(worst, abs(o.outputs[0].logprobs[0][token].logprob - ref["logprobs"][0][token].item()))
    assert worst < 0.05, worst
    assert sorted((out.parent.parent / "quantized").glob("*.safetensors")) == cached
