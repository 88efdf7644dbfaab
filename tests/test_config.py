"""EngineArgs -> EngineConfig: speculative_config and quantization are checked when the engine is
configured, with clear ValueErrors."""

import pytest
import torch

from pagedllm.config import GGUF_CPU_QUANTIZATION, QUANTIZATION_METHODS, check_quantization, resolve_quantization
from pagedllm.engine.arg_utils import EngineArgs

# ---- speculative_config --------------------------------------------------------------------------------------

def _config(tiny_llama, spec):
    return EngineArgs(model=tiny_llama, speculative_config=spec).create_engine_config().speculative_config


def test_ngram_defaults_and_json(tiny_llama):
    spec = _config(tiny_llama, '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram", 3, 4, 4)
    assert spec.num_lookahead_tokens == 0
    spec = _config(tiny_llama, {"method": "ngram", "num_speculative_tokens": 2})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    assert _config(tiny_llama, None) is None


def test_draft_model_config(tiny_llama):
    spec = _config(tiny_llama, {"model": tiny_llama, "num_speculative_tokens": 2})
    assert spec.method == "draft_model" and spec.num_lookahead_tokens == 2
    assert spec.draft_model_config.model_path == tiny_llama


@pytest.mark.parametrize("spec,message", [
    ({"method": "lookahead", "num_speculative_tokens": 2}, "method must be one of 'ngram', 'draft_model', 'medusa'"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "method 'eagle3' needs 'model'"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method 'medusa' needs 'model'"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 1}, "unknown keys"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ("{not json", "not valid JSON"),
])
def test_bad_configs(tiny_llama, spec, message):
    with pytest.raises(ValueError, match=message):
        _config(tiny_llama, spec)


def test_draft_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 100}))
    with pytest.raises(ValueError, match="vocabulary"):
        _config(tiny_llama, {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})


def test_long_prefill_token_threshold(tiny_llama):
    config = EngineArgs(model=tiny_llama, long_prefill_token_threshold=32).create_engine_config()
    assert config.scheduler_config.long_prefill_token_threshold == 32
    with pytest.raises(ValueError, match="must be >= 0"):
        EngineArgs(model=tiny_llama, long_prefill_token_threshold=-1).create_engine_config()
    with pytest.raises(ValueError, match="needs chunked prefill"):
        EngineArgs(model=tiny_llama, long_prefill_token_threshold=32,
                   enable_chunked_prefill=False).create_engine_config()


# ---- quantization ---------------------------------------------------------------------------------------------

def test_unknown_quantization_method_is_a_value_error(tiny_gemma3):
    with pytest.raises(ValueError, match="quantization must be None, 'none' or one of int8, int4, fp8, gguf, gptq"):
        EngineArgs(model=tiny_gemma3, quantization="int3").create_engine_config()


@pytest.mark.parametrize("method", ["int8", "int4", "gguf"])
def test_quantization_is_cpu_only(method):
    check_quantization(method, torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization(method, torch.device("cuda"))


def test_gguf_quantization_needs_a_gguf_file(tiny_gemma3):
    """"gguf" runs a GGUF file's own blocks, and what a quantized GGUF runs as on CPU by default;
    a checkpoint that is no GGUF conversion has none to run."""
    assert "gguf" in QUANTIZATION_METHODS and GGUF_CPU_QUANTIZATION == "gguf"
    with pytest.raises(ValueError, match="quantization='gguf' runs a GGUF file's own blocks; .* is not a GGUF file"):
        resolve_quantization("gguf", tiny_gemma3, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        EngineArgs(model=tiny_gemma3, quantization="gguf").create_engine_config()


def test_a_float_checkpoint_is_not_quantized_by_default(tiny_gemma3):
    assert EngineArgs(model=tiny_gemma3).create_engine_config().model_config.quantization is None
    config = EngineArgs(model=tiny_gemma3, quantization="none").create_engine_config()
    assert config.model_config.quantization is None


def test_config_describes_and_never_converts(tiny_llama, monkeypatch):
    """config.py builds from resolved files; only EngineArgs (engine/arg_utils.py) resolves names and
    paths, which for a GGUF means converting it."""
    import pagedllm.config as config
    from pagedllm.transformers_utils import gguf_loader, model_path

    def no_conversion(path):
        raise AssertionError("config.py converted a file")

    monkeypatch.setattr(gguf_loader, "convert_gguf", no_conversion)
    mc = config.build_model_config("tiny", tiny_llama, None, "float32", torch.device("cpu"), None, 0, False)
    assert mc.model_path == tiny_llama and mc.model == "tiny"
    spec = config.parse_speculative_config({"model": "some/draft.gguf", "num_speculative_tokens": 2})
    assert spec.method == "draft_model" and spec.model == "some/draft.gguf" and spec.draft_model_config is None
    assert not hasattr(config, "resolve_model_path") and not hasattr(config, "convert_gguf")
    resolved = []
    monkeypatch.setattr("pagedllm.engine.arg_utils.resolve_model_path",
                        lambda m, *args: resolved.append(m) or model_path.resolve_model_path(m, *args))
    EngineArgs(model=tiny_llama, dtype="float32").create_engine_config()
    assert resolved == [tiny_llama]
