"""`LLM(model, pipeline_parallel_size=2)`: each stage holds only its layers (and their KV cache),
hands its hidden states to the next over torch.distributed, and the engine core keeps one step in
flight per stage; greedy tokens equal one rank's, alone and with tensor parallelism."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.utils import PP_LAYER_PARTITION_ENV, get_pp_indices
from pagedllm.engine.arg_utils import EngineArgs
from tests.utils import make_tiny_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 60)), [3, 4]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Gemma3 with tied embeddings: the last stage has no embedding, so its LM head loads a copy.
MODELS = {"llama": {}, "qwen3": {"num_key_value_heads": 1}, "gemma3": {"final_logit_softcapping": 5.0}}


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=32, **kw)


@pytest.mark.parametrize("arch", list(MODELS))
def test_pp2_greedy_tokens_equal_one_rank(arch, tmp_path):
    path = make_tiny_model(str(tmp_path), arch, **MODELS[arch])
    one = _llm(path)
    expected = _tokens(one)
    bytes_one = one.llm_engine.engine_core.model_executor.bytes_per_block()
    two = _llm(path, pipeline_parallel_size=2)
    try:
        core = two.llm_engine.engine_core
        assert core.batch_queue_size == 2 and core.model_executor.output_rank == 1
        assert _tokens(two) == expected
        # 3 layers: the first stage holds two, the last one (and only their K/V).
        per_layer = bytes_one // 3
        assert core.model_executor.collective_rpc("get_bytes_per_block") == [2 * per_layer, per_layer]
    finally:
        two.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])  # one KV head shared by two ranks; local/global layers
def test_tp2_times_pp2_and_a_layer_partition(arch, tmp_path, monkeypatch):
    path = make_tiny_model(str(tmp_path), arch, **MODELS[arch])
    expected = _tokens(_llm(path))
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "1,2")
    four = _llm(path, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        executor = four.llm_engine.engine_core.model_executor
        assert len(executor.worker_pids) == 4 and executor.output_rank == 2
        assert _tokens(four) == expected
        first, last = executor.collective_rpc("get_bytes_per_block")[::2]
        assert last == 2 * first  # the partition override: one layer, then two
    finally:
        four.llm_engine.engine_core.shutdown()


def test_layer_partition_rule(monkeypatch):
    assert [get_pp_indices(10, s, 4) for s in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert [get_pp_indices(3, s, 2) for s in range(2)] == [(0, 2), (2, 3)]
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "4,6")
    assert get_pp_indices(10, 1, 2) == (4, 10)
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "4,5")
    with pytest.raises(ValueError, match="add up to the model's 10 layers"):
        get_pp_indices(10, 0, 2)


def test_layouts_that_do_not_split_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 is more than the 3 layers"):
        EngineArgs(model=tiny_llama, pipeline_parallel_size=4).create_engine_config()
    with pytest.raises(ValueError, match="draft model .* needs pipeline_parallel_size=1"):
        EngineArgs(model=tiny_llama, pipeline_parallel_size=2,
                   speculative_config={"model": tiny_llama, "num_speculative_tokens": 2}).create_engine_config()
    with pytest.raises(ValueError, match="needs 'mp' or 'ray'"):
        EngineArgs(model=tiny_llama, pipeline_parallel_size=2,
                   distributed_executor_backend="uni").create_engine_config()
