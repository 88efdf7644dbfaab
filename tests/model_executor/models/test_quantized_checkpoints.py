"""GPTQ, AWQ, FP8 and compressed-tensors checkpoints through the engine (their method read from
config.json, as vLLM reads it) against transformers running the same dequantized weights in
float32, the layers holding the repacked blocks and no float copy.

Without the C kernels the blocks are dequantized and multiplied in float32: the greedy tokens
are then transformers' exactly (the repack and the act-order input order are exact). The
kernels quantize activations to int8 per 32 values, as for GGUF files: on these random tiny
models that moves a logprob by up to ~0.1, so their tokens agree up to ties that close."""

from __future__ import annotations

import pytest

from pagedllm.model_executor.layers.gguf_linear import GGUFLinear
from tests.transformers_utils.quant_writers import write_8bit, write_dequantized, write_quantized, write_tiny_llama
from tests.utils import assert_greedy_match, hf_greedy

PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 200, 13], list(range(1, 18))]
MAX_TOKENS = 10
CASES = {
    "gptq-int4": dict(method="gptq", bits=4, group=128, sym=True),
    "gptq-int4-act-order": dict(method="gptq", bits=4, group=32, sym=False, desc_act=True),
    "gptq-int8": dict(method="gptq", bits=8, group=64, sym=True),
    "awq": dict(method="awq", bits=4, group=128, sym=False),
    "compressed-tensors-w4a16": dict(method="compressed-tensors", bits=4, group=64, sym=True),
    # 8-bit weights in a plain `weight` tensor (write_8bit)
    "fp8-static": dict(method="fp8", static=True),
    "fp8-block": dict(method="fp8", strategy="block", block=(64, 128)),  # DeepSeek-V3's / Qwen3's FP8 layout
    "compressed-tensors-fp8": dict(method="compressed-tensors", fmt="float-quantized", strategy="channel"),
    "compressed-tensors-w8a8": dict(method="compressed-tensors", fmt="int-quantized", strategy="channel"),
}


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    src = tmp_path_factory.mktemp("float")
    write_tiny_llama(src, None, tie_word_embeddings=False)
    return src


def quantized(float_model, root, case: dict):
    """(the checkpoint's directory, the greedy reference on its dequantized weights)"""
    path = root / "quantized"
    ref = (write_8bit if "fmt" in case or case["method"] == "fp8" else write_quantized)(float_model, path, **case)
    write_dequantized(float_model, root / "dequantized", ref)
    return path, hf_greedy(str(root / "dequantized"), PROMPTS, MAX_TOKENS)


# Float8 weights are blocked with a rounding of their smallest values (int_blocks.float_blocks),
# so even the float path is near, not equal, to the reference.
RUNS = [(name, False) for name in CASES] + [("gptq-int4", True), ("gptq-int4-act-order", True), ("gptq-int8", True),
                                            ("fp8-static", True), ("fp8-block", True),
                                            ("compressed-tensors-w8a8", True)]


@pytest.mark.parametrize("name, kernels", RUNS, ids=[f"{n}-{'kernels' if k else 'float'}" for n, k in RUNS])
def test_greedy_matches_the_dequantized_reference(float_model, tmp_path, monkeypatch, name, kernels):
    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.layers import cpu_kernels

    if not kernels:
        monkeypatch.setattr(cpu_kernels, "_lib", None)
    elif cpu_kernels.kernels() is None:
        pytest.skip("the C kernels are not built here")
    path, ref = quantized(float_model, tmp_path, CASES[name])
    llm = LLM(str(path), max_model_len=128, kv_cache_memory=1 << 24, dtype="float32")
    try:
        assert llm.llm_engine.config.model_config.quantization == CASES[name]["method"]
        model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
        blocks = [m for m in model.modules() if isinstance(getattr(m, "gguf", None), GGUFLinear)]
        assert len(blocks) == 2 * 4  # q/k/v, o, gate/up, down a layer; the head stays float
        for m in blocks:
            assert m.weight.numel() == 0  # no float copy
            assert (m.gguf.input_perm is not None) == bool(CASES[name].get("desc_act"))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    finally:
        llm.llm_engine.shutdown()
    float8 = CASES[name]["method"] == "fp8" or CASES[name].get("fmt") == "float-quantized"
    assert_greedy_match(got, ref, tol=0.25 if kernels else 0.05 if float8 else 1e-3)


def test_asking_for_another_method_is_an_error(float_model, tmp_path):
    from pagedllm import LLM

    write_quantized(float_model, tmp_path / "q", method="awq", sym=False)
    with pytest.raises(ValueError, match="is a awq checkpoint"):
        LLM(str(tmp_path / "q"), quantization="int4")
    with pytest.raises(ValueError, match="needs a gptq checkpoint"):
        LLM(str(float_model), quantization="gptq")


@pytest.mark.parametrize("name", ["awq", "compressed-tensors-w8a8"])
def test_tp2_ranks_take_their_rows_and_columns_of_the_blocks(float_model, tmp_path, monkeypatch, name):
    """Two ranks: column-parallel layers cut the blocks (and a per-channel scale) by rows,
    row-parallel ones by whole blocks of inputs; the tokens are the one-rank reference's (float
    path, exact)."""
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")  # the worker processes read it
    path, ref = quantized(float_model, tmp_path, CASES[name])
    llm = LLM(str(path), max_model_len=128, kv_cache_memory=1 << 24, dtype="float32", tensor_parallel_size=2)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    finally:
        llm.llm_engine.shutdown()
    assert_greedy_match(got, ref)


def test_served_with_the_openai_sdk(float_model, tmp_path, tmp_path_factory):
    """`pagedllm serve` on a GPTQ act-order checkpoint: the openai SDK's completions are the
    dequantized reference's greedy tokens (float path, exact), and /v1/models lists it. (The
    server loads every format through the loader the offline tests above run.)"""
    import openai
    from transformers import AutoTokenizer

    from tests.entrypoints.openai.serve_utils import API_KEY, MODEL, serve_tiny

    path, ref = quantized(float_model, tmp_path, CASES["gptq-int4-act-order"])
    tok = AutoTokenizer.from_pretrained(path)
    serving = serve_tiny(str(path), tmp_path_factory, env={"PAGEDLLM_CPU_KERNELS": "0"})
    url = next(serving)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY)
        assert [m.id for m in client.models.list().data] == [MODEL]
        for ids, want in zip(PROMPTS, ref):
            out = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == tok.decode(want["tokens"])
            assert out.usage.completion_tokens == MAX_TOKENS
    finally:
        serving.close()


def test_online_fp8_quantizes_a_float_checkpoint(float_model, tmp_path):
    """`quantization="fp8"` on a float checkpoint: every decoder linear becomes float8 e4m3 with a
    scale per output channel, held as blocks with no float copy; greedy decoding follows
    transformers on those e4m3 weights (dequantized) up to near-ties."""
    from safetensors.torch import load_file, save_file

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.layers import cpu_kernels
    from pagedllm.model_executor.layers.quantization import quantize_fp8
    from tests.transformers_utils.quant_writers import LINEARS

    if cpu_kernels.kernels() is None:
        pytest.skip("the C kernels are not built here")
    state = load_file(str(float_model / "model.safetensors"))
    for name, w in state.items():
        if name.endswith(".weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] in LINEARS:
            q, scale = quantize_fp8(w)
            state[name] = q.float() * scale[:, None]
    dequantized = tmp_path / "fp8-dequantized"
    dequantized.mkdir()
    for f in float_model.iterdir():
        if f.name != "model.safetensors":
            (dequantized / f.name).write_bytes(f.read_bytes())
    save_file(state, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    ref = hf_greedy(str(dequantized), PROMPTS, MAX_TOKENS)
    llm = LLM(str(float_model), quantization="fp8", max_model_len=128, kv_cache_memory=1 << 24)
    try:
        model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
        blocks = [m for m in model.modules() if isinstance(getattr(m, "gguf", None), GGUFLinear)]
        assert len(blocks) == 2 * 4 and all(m.weight.numel() == 0 for m in blocks)
        assert all(seg.out_scale is not None for m in blocks for seg in m.gguf.segments)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    finally:
        llm.llm_engine.shutdown()
    assert_greedy_match(got, ref, tol=0.25)
