"""`LLM(model, tensor_parallel_size=2)`: two worker processes, each with half the heads (and half
the KV cache), give the same greedy tokens as one rank; layouts that do not split are refused
before any process starts."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from tests.utils import make_tiny_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

# Head counts that split over two ranks: Llama's 2 kv heads one per rank; Qwen3's single kv head
# replicated on both; Gemma3 with an odd vocabulary (385 tokens, padded to 386 over the ranks),
# tied embeddings and a logit softcap.
MODELS = {
    "llama": {},
    "qwen3": {"num_key_value_heads": 1},
    "gemma3": {"added_tokens": ("<extra>",), "final_logit_softcapping": 5.0},
}


def _llm(path: str, tp: int) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory=1 << 22, tensor_parallel_size=tp)


@pytest.mark.parametrize("arch", list(MODELS))
def test_tp2_greedy_tokens_equal_one_rank(arch, tmp_path):
    path = make_tiny_model(str(tmp_path), arch, **MODELS[arch])
    one = _llm(path, 1)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    bytes_one = one.llm_engine.engine_core.model_executor.bytes_per_block()
    two = _llm(path, 2)
    try:
        executor = two.llm_engine.engine_core.model_executor
        assert len(executor.worker_pids) == 2
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        # Each rank caches its own kv heads: half of them, or the one replicated head.
        kv_heads = MODELS[arch].get("num_key_value_heads", 2)
        per_rank = bytes_one // 2 if kv_heads % 2 == 0 else bytes_one
        assert executor.collective_rpc("get_bytes_per_block") == [per_rank, per_rank]
    finally:
        two.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("overrides, tp, message", [
    ({"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}, 2,
     "num_attention_heads=3 is not divisible by 2"),
    ({"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 4}, 3,
     "num_key_value_heads=4 and 3 do not divide one another"),
    ({"intermediate_size": 130}, 4, "intermediate_size=130 is not divisible by 4"),
])
def test_layouts_that_do_not_split_are_refused(tmp_path, overrides, tp, message):
    path = make_tiny_model(str(tmp_path), "llama", **overrides)
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} does not fit .*: {message}"):
        EngineArgs(model=path, tensor_parallel_size=tp).create_engine_config()


def test_kv_heads_may_divide_or_be_divided(tiny_llama):
    """tiny_llama's 4 query and 2 kv heads: 4 ranks replicate each kv head twice."""
    config = EngineArgs(model=tiny_llama, tensor_parallel_size=4).create_engine_config()
    assert (config.parallel_config.world_size, config.parallel_config.distributed_executor_backend) == (4, "mp")
