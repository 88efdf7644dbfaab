"""Multi-LoRA against PEFT: tiny random checkpoints, adapters made with `peft` (random A and B,
so every delta is real), greedy float32 tokens equal to transformers + PeftModel, with three
adapters of different ranks and targets mixed in one batch with base-model requests."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.lora_request import LoRARequest
from tests.utils import assert_greedy_match, assert_idle, make_tiny_model

# peft is imported where an adapter is made: it pulls in much of transformers, which only the
# worker that runs these tests should pay for at collection.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (the test extra)")

ADAPTERS = {  # name → (rank, alpha, targets, rsLoRA)
    "attn8": (8, 16, ["q_proj", "v_proj"], False),
    "mlp16": (16, 8, ["gate_proj", "up_proj", "down_proj"], False),
    "all64": (64, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
}
PROMPTS = ["The quick brown fox", "Hello, my name is", "Paged attention stores keys", "Unicode: caf"]


def make_adapter(base: str, path: str, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                        init_lora_weights=False)  # random B too: the adapter changes the output
    peft_model = get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(path)
    return path


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    results = []
    for ids in prompts:
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        results.append({"tokens": out.sequences[0, len(ids):].tolist(),
                        "logprobs": [torch.log_softmax(s[0].float(), -1) for s in out.logits]})
    return results


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def base_and_adapters(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = make_tiny_model(str(root / "base"), request.param)
    adapters = {name: make_adapter(base, str(root / name), *spec, seed=i)
                for i, (name, spec) in enumerate(ADAPTERS.items())}
    return base, adapters


def test_mixed_batch_equals_peft_and_each_alone(base_and_adapters):
    base, adapters = base_and_adapters
    llm = LLM(base, dtype="float32", kv_cache_memory=1 << 24, enable_lora=True, max_loras=3, max_lora_rank=64,
              max_num_seqs=16)
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS]
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    # Every prompt under every adapter and the base model, all in one batch.
    jobs = [(p, lora) for p in range(len(PROMPTS)) for lora in [None, *loras.values()]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids[p]} for p, _ in jobs], params, use_tqdm=False,
                        lora_request=[lora for _, lora in jobs])
    got = {(p, lora.lora_name if lora else None): o.outputs[0].token_ids for (p, lora), o in zip(jobs, outs)}
    for name in [None, *adapters]:
        ref = peft_greedy(base, adapters.get(name), ids, 8)
        assert_greedy_match([got[(p, name)] for p in range(len(PROMPTS))], ref)
    # Each adapter changes the output, and a request alone gives what it gave in the batch.
    assert all(got[(p, name)] != got[(p, None)] for name in adapters for p in range(len(PROMPTS)))
    for p, lora in jobs[::5]:
        alone = llm.generate({"prompt_token_ids": ids[p]}, params, use_tqdm=False, lora_request=lora)
        assert alone[0].outputs[0].token_ids == got[(p, lora.lora_name if lora else None)]
    assert_idle(llm)


def test_adapters_beyond_the_slots_wait_their_turn(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_slots")
    paths = [make_adapter(tiny_llama, str(root / f"a{i}"), 8, 16, ["q_proj", "o_proj"], False, seed=10 + i)
             for i in range(3)]
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24, enable_lora=True, max_loras=1,
              max_cpu_loras=2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    mixed = llm.generate(["Hello"] * 6, params, use_tqdm=False, lora_request=loras * 2)
    for lora, out in zip(loras * 2, mixed):
        alone = llm.generate("Hello", params, use_tqdm=False, lora_request=lora)
        assert out.outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert_idle(llm)


def test_prefix_cache_is_keyed_by_adapter(tiny_llama, tmp_path_factory):
    path = make_adapter(tiny_llama, str(tmp_path_factory.mktemp("lora_pc") / "a"), 8, 16, ["q_proj", "k_proj",
                                                                                             "v_proj"], False, 3)
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24, enable_lora=True)
    prompt = "Paged attention stores keys and values in fixed-size blocks. " * 2
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    lora = LoRARequest("a", 1, path)
    base = llm.generate(prompt, params, use_tqdm=False)[0]
    first = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
    again = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0  # never the base model's blocks
    assert first.outputs[0].token_ids == again.outputs[0].token_ids != base.outputs[0].token_ids


def test_bad_adapters_are_clear_errors(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_bad")
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(max_tokens=2)
    big = make_adapter(tiny_llama, str(root / "big"), 16, 16, ["q_proj"], False, 1)
    other_base = make_tiny_model(str(root / "other_base"), "llama", intermediate_size=96)
    other = make_adapter(other_base, str(root / "other"), 8, 16, ["gate_proj"], False, 1)
    (root / "empty").mkdir()
    cases = [(big, "rank 16 is above --max-lora-rank 8"), (other, "was it trained for another model"),
             (str(root / "missing"), "not a directory"), (str(root / "empty"), "no adapter_config.json")]
    for i, (path, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            llm.generate("Hi", params, use_tqdm=False, lora_request=LoRARequest(f"x{i}", 10 + i, path))
    embed = make_adapter(tiny_llama, str(root / "embed"), 8, 16, ["embed_tokens"], False, 1)
    with pytest.raises(ValueError, match="embed_tokens / lm_head"):
        llm.generate("Hi", params, use_tqdm=False, lora_request=LoRARequest("e", 20, embed))
    assert llm.generate("Hi", params, use_tqdm=False)[0].finished  # the engine is fine
    plain = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("Hi", params, use_tqdm=False, lora_request=LoRARequest("a", 1, big))
    assert os.path.isdir(big)
