"""Out-of-tree models: ModelRegistry.register_model with a class defined here (or its
"module:Class" path) serves an architecture pagedllm does not ship, in process and in worker
processes; an unknown architecture is a clear error at configuration time."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedllm import LLM, ModelRegistry, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.registry import OOT_MODELS_ENV
from tests.utils import hf_greedy


class TinyOOTForCausalLM(LlamaForCausalLM):
    """A user's model: here a Llama under another name, counting its constructions."""

    built = 0

    def __init__(self, config) -> None:
        super().__init__(config)
        TinyOOTForCausalLM.built += 1


@pytest.fixture
def oot_checkpoint(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.setenv(OOT_MODELS_ENV, "{}")  # restored after the test: registrations do not leak
    path = str(tmp_path / "oot")
    shutil.copytree(tiny_llama, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["TinyOOTForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def test_unregistered_architecture_is_a_clear_error(oot_checkpoint):
    with pytest.raises(ValueError, match="'TinyOOTForCausalLM' .* is not supported; .*register_model"):
        EngineArgs(oot_checkpoint).create_engine_config()


@pytest.mark.parametrize("how", ["class", "path"])
@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_registered_model_serves(oot_checkpoint, tiny_llama, how, backend):
    target = TinyOOTForCausalLM if how == "class" else f"{__name__}:TinyOOTForCausalLM"
    ModelRegistry.register_model("TinyOOTForCausalLM", target)
    assert "TinyOOTForCausalLM" in ModelRegistry.get_supported_archs()
    before = TinyOOTForCausalLM.built
    llm = LLM(oot_checkpoint, dtype="float32", kv_cache_memory=1 << 24, distributed_executor_backend=backend)
    ids = llm.get_tokenizer()("Hello, my name is").input_ids
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_llama, [ids], 6)[0]["tokens"]
    assert TinyOOTForCausalLM.built == before + (backend == "uni")  # mp built it in the worker process
    llm.llm_engine.engine_core.shutdown()


def test_register_model_rejects_bad_targets():
    with pytest.raises(ValueError, match="module:Class"):
        ModelRegistry.register_model("X", "no_colon")
    with pytest.raises(ValueError, match="a class or 'module:Class'"):
        ModelRegistry.register_model("X", 3)
