"""The offline `LLM` API: outputs, ordering, batch independence, validation."""

from __future__ import annotations

import json
import os

import pytest

from pagedllm import LLM, CompletionOutput, RequestOutput, SamplingParams


def test_generate_returns_request_outputs_in_order(llm):
    prompts = ["Hello, my name is", "The quick brown fox", [5, 6, 7]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello, my name is", "The quick brown fox", None]
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs):
        assert isinstance(out, RequestOutput) and out.finished
        expected_ids = tok(prompt).input_ids if isinstance(prompt, str) else prompt
        assert out.prompt_token_ids == expected_ids
        (c,) = out.outputs
        assert isinstance(c, CompletionOutput) and c.index == 0
        assert len(c.token_ids) == 8 and c.finish_reason == "length" and c.stop_reason is None
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        m = out.metrics
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_prompt_output_independent_of_batch(llm):
    """Greedy output alone equals the output inside a batch of 32 other prompts."""
    target = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [[(7 * i + j) % 300 + 3 for j in range(5 + i % 23)] for i in range(32)]
    batch = others[:16] + [target] + others[16:]
    together = llm.generate(batch, params, use_tqdm=False)[16].outputs[0].token_ids
    assert alone == together


def test_seeded_sampling_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    target = [20, 21, 22, 23]
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    noisy = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 5
    batch = llm.generate([[3, 4]] * 5 + [target], noisy + [params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=12, ignore_eos=True)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_token_ids_and_eos(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ids = llm.generate([[9, 8, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = ids[3]
    first = ids.index(stop_tok)
    out = llm.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_invalid_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    too_long = [5] * 600
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([too_long], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**7]], use_tqdm=False)
    # A bad prompt in a batch leaves nothing behind.
    with pytest.raises(ValueError):
        llm.generate([[5, 6], ""], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_invalid_model_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="not a model"):
        LLM(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"123")
    with pytest.raises(ValueError, match="gguf"):
        LLM(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="unknown engine arguments"):
        LLM(str(tmp_path), not_a_flag=1)


def test_unknown_architecture(tiny_llama, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*not supported"):
        LLM(str(d), kv_cache_memory=1 << 22)
    assert os.path.isdir(d)


def test_kv_cache_too_small_is_a_clear_error(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_llama, num_gpu_blocks_override=2)
