"""A pre-quantized checkpoint's float LM head on CPU: ranked on int4 / W8A8 copies with its top
candidates re-scored (`loader/quantize.rank_float_heads`), its table left mapped in the file's
bf16 in a float32 model, the rows whose logprobs go back to a user computed from the float
weight whole; and the memory that leaves a 1B-shaped tied head in."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.transformers_utils.quant_writers import write_8bit, write_dequantized, write_tiny_llama
from tests.utils import assert_greedy_match, build_tokenizer, hf_greedy

PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 200, 13], list(range(1, 18))]
MAX_TOKENS = 8
VOCAB = 4096  # more rows than the 256 candidates re-scored, so the copies' tail is in the logits


def _kernels() -> None:
    from pagedllm.model_executor.layers import cpu_kernels

    if cpu_kernels.kernels() is None:
        pytest.skip("the C kernels are not built here")


@pytest.fixture(scope="module")
def w8a8_tied(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A tied Llama in bf16 written as compressed-tensors W8A8, and transformers' greedy
    reference on its dequantized weights in float32."""
    root = tmp_path_factory.mktemp("tied")
    src = root / "float"
    write_tiny_llama(src, VOCAB, tie_word_embeddings=True, dtype=torch.bfloat16)
    path = root / "w8a8"
    ref = write_8bit(src, path, method="compressed-tensors", fmt="int-quantized", strategy="channel")
    write_dequantized(src, root / "dequantized", ref)
    return path, hf_greedy(str(root / "dequantized"), PROMPTS, MAX_TOKENS)


def _run(path: Path, params) -> tuple[list, torch.nn.Module | None]:
    from pagedllm import LLM

    llm = LLM(str(path), max_model_len=128, kv_cache_memory=1 << 24, dtype="float32")
    try:
        model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
        head, embed = model.lm_head, model.model.embed_tokens
        layout = {"ranked": head.quant is not None, "exact_rows": head.quant is not None and head.quant.exact_rows,
                  "packed": head.packed is not None, "table": embed.weight.dtype, "rows": embed.dtype}
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params), layout
    finally:
        llm.llm_engine.shutdown()


def test_greedy_and_logprobs_are_the_float_heads(w8a8_tied, monkeypatch):
    from pagedllm import SamplingParams

    _kernels()
    path, ref = w8a8_tied
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    ranked, layout = _run(path, params)
    assert layout == {"ranked": True, "exact_rows": True, "packed": False, "table": torch.bfloat16,
                      "rows": torch.float32}
    assert_greedy_match([o.outputs[0].token_ids for o in ranked], ref, tol=0.25)
    monkeypatch.setenv("PAGEDLLM_RANK_FLOAT_HEAD", "0")
    packed, layout = _run(path, params)
    assert layout == {"ranked": False, "exact_rows": False, "packed": True, "table": torch.float32,
                      "rows": torch.float32}
    for a, b in zip(ranked, packed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:], b.outputs[0].logprobs + b.prompt_logprobs[1:]):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) < 1e-4, (t, la[t], lb[t])


def test_sampled_rows_rank_on_the_copies(w8a8_tied):
    """Without logprobs asked, a step's logits are the copies' outside each row's top 256: the
    ranking is what runs (the exact rows above are not all rows)."""
    from pagedllm.forward_context import exact_logit_rows
    from pagedllm.model_executor.layers.quantization import QuantizedLMHead

    _kernels()
    from pagedllm import LLM

    llm = LLM(str(w8a8_tied[0]), max_model_len=128, kv_cache_memory=1 << 24, dtype="float32")
    try:
        head = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model.lm_head
        assert isinstance(head.quant, QuantizedLMHead)
        hidden = torch.randn(3, 256) * 0.5
        weight = head.tied_to.weight
        exact = hidden @ weight.float().T
        ranked = head(hidden).float()
        with exact_logit_rows(torch.tensor([1])):
            mixed = head(hidden).float()
    finally:
        llm.llm_engine.shutdown()
    same = (ranked - exact).abs() < 1e-4
    assert (same.sum(dim=1) >= 256).all()  # each row's 256 candidates re-scored from the float weight
    assert same.gather(1, exact.topk(32, dim=-1).indices).all()  # the float head's best among them
    assert (~same).sum(dim=1).min() > VOCAB // 2  # the tail is the copies'
    assert torch.allclose(mixed[1], exact[1], atol=1e-4)
    assert torch.equal(mixed[[0, 2]], ranked[[0, 2]])


_CHILD = textwrap.dedent("""
    import json, sys
    from pagedllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_model_len=256, kv_cache_memory=int(sys.argv[2]), dtype="float32")
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0))
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"peak": int(hwm.split()[1]) * 1024, "tokens": len(out[0].outputs[0].token_ids)}))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="the peak is read from /proc")
def test_a_1b_shaped_tied_head_fits_the_checkpoint_plus_kv_plus_1gib(tmp_path):
    """Llama-3.2-1B's tied 128,256 x 2,048 table in bf16 (525 MB) beside one small W8A8 layer,
    served in float32: a float32 copy of the table and oneDNN's packed float32 copy of the head
    (2.1 GB) would not fit 1.2 x the checkpoint + the KV cache + 1 GiB; the mapped table and its
    ranking copies (0.4 GB) do."""
    from safetensors.torch import save_file

    _kernels()
    src = tmp_path / "float"
    build_tokenizer(str(src))
    hidden, inter, vocab = 2048, 1024, 128256
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": 16, "num_key_value_heads": 4,
           "head_dim": 128, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    (src / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    shapes = {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (512, hidden),
              p + "self_attn.v_proj.weight": (512, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
              p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
              p + "mlp.down_proj.weight": (hidden, inter)}
    tensors = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}
    tensors["model.embed_tokens.weight"] = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(torch.bfloat16)
    for name in (p + "input_layernorm.weight", p + "post_attention_layernorm.weight", "model.norm.weight"):
        tensors[name] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    path = tmp_path / "w8a8"
    write_8bit(src, path, method="compressed-tensors", fmt="int-quantized", strategy="channel")
    (src / "model.safetensors").unlink()
    size = (path / "model.safetensors").stat().st_size
    kv = 64 << 20
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(kv)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 4
    bound = 1.2 * size + kv + (1 << 30)
    assert result["peak"] <= bound, f"peak RSS {result['peak'] / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB"
