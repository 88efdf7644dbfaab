"""The engine core reaches its model only through an Executor (one rank in-process by default),
every call a `collective_rpc` by Worker method name; parallel layouts are checked, and those not
available are refused clearly."""

from __future__ import annotations

import argparse

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace
from pagedllm.executor import executor_class
from pagedllm.executor.uniproc_executor import UniProcExecutor


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24)


def test_the_engine_core_runs_on_a_uniproc_executor(llm):
    core = llm.llm_engine.engine_core
    executor = core.model_executor
    assert type(executor) is executor_class(core.config) is UniProcExecutor
    assert executor.collective_rpc("determine_num_blocks") == [executor.driver_worker.determine_num_blocks()]
    assert executor.determine_num_blocks() == core.config.cache_config.num_blocks
    assert executor.determine_available_memory() == [1 << 24]
    assert executor.determine_num_blocks() == (1 << 24) // executor.bytes_per_block()
    assert executor.bytes_per_block() == executor.driver_worker.model_runner.bytes_per_block()
    executor.check_health()
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(AttributeError):
        executor.collective_rpc("no_such_method")


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
     "tensor_parallel_size=2 x pipeline_parallel_size=1 needs 'mp' or 'ray'"),
    ({"pipeline_parallel_size": 4}, "pipeline_parallel_size=4 is more than the 3 layers"),
    ({"distributed_executor_backend": "threads"}, "must be one of uni, mp, ray"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
])
def test_parallel_layouts_that_cannot_run_are_refused_clearly(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=tiny_llama, **kwargs).create_engine_config()


def test_tensor_parallelism_defaults_to_worker_processes(tiny_llama):
    config = EngineArgs(model=tiny_llama, tensor_parallel_size=2).create_engine_config().parallel_config
    assert (config.world_size, config.distributed_executor_backend) == (2, "mp")
    assert config.distributed_init_method is None  # the executor picks it when it starts the ranks


def test_cli_flags_reach_the_parallel_config(tiny_llama):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", tiny_llama, "-tp", "1", "-pp", "1", "-dp", "1",
                              "--distributed-executor-backend", "uni"])
    config = engine_args_from_namespace(args).create_engine_config().parallel_config
    assert (config.world_size, config.data_parallel_size, config.distributed_executor_backend) == (1, 1, "uni")
    args = parser.parse_args(["--model", tiny_llama, "--tensor-parallel-size", "2"])
    config = engine_args_from_namespace(args).create_engine_config().parallel_config
    assert (config.tensor_parallel_size, config.distributed_executor_backend) == (2, "mp")
