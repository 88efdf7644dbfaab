"""Loading a checkpoint: a vocabulary table (embedding, LM head) is memory-mapped where it is
stored in the model's dtype in a cache that replaces files whole (a copy-on-write map: the file
never changes), and read (and converted) otherwise."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pagedllm.config import build_model_config
from pagedllm.model_executor.loader.model_loader import get_model, init_dummy_weights
from pagedllm.transformers_utils import weight_utils
from tests.utils import make_tiny_model


@pytest.mark.parametrize("dtype, in_cache", [("float32", True), ("bfloat16", True), ("float32", False)])
def test_embedding_mapped_in_its_stored_dtype(tmp_path, monkeypatch, dtype, in_cache):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path if in_cache else tmp_path / "cache"))
    path = make_tiny_model(str(tmp_path / "llama"), "llama")
    stored = load_file(str(tmp_path / "llama" / "model.safetensors"))["model.embed_tokens.weight"]
    assert stored.dtype == torch.float32
    mapped = []  # the shape of each table mapped
    real = weight_utils.CheckpointTensor.mapped

    def spy(self):
        tensor = real(self)
        if tensor is not None:
            mapped.append(self.shape)
        return tensor

    monkeypatch.setattr(weight_utils.CheckpointTensor, "mapped", spy)
    config = build_model_config(None, path, None, dtype, torch.device("cpu"), None, 0, False, quantization="none")
    model = get_model(config, torch.device("cpu"))
    weight = model.model.embed_tokens.weight
    # the embedding, and this untied model's LM head
    assert mapped == ([stored.shape] * 2 if dtype == "float32" and in_cache else [])
    assert weight.dtype == config.dtype and torch.equal(weight.float(), stored.to(config.dtype).float())
    before = (tmp_path / "llama" / "model.safetensors").read_bytes()
    with torch.no_grad():
        weight.add_(1.0)
    assert (tmp_path / "llama" / "model.safetensors").read_bytes() == before


def test_dummy_weights_on_cpu_are_float32_draws_from_one_seeded_generator():
    """The CPU draw is pinned: float32 values from a CPU generator seeded 0, parameter after
    parameter, rounded to each parameter's dtype (a GPU draws in place, on its own generator)."""
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.empty(3, 5, dtype=torch.bfloat16))
    model.b = torch.nn.Parameter(torch.empty(7))
    init_dummy_weights(model)
    gen = torch.Generator().manual_seed(0)
    for param in (model.a, model.b):
        want = torch.empty(param.shape).uniform_(-1e-3, 1e-3, generator=gen).to(param.dtype)
        assert torch.equal(param.data, want)


def test_quantization_is_refused_off_the_cpu_before_the_model_is_built(tmp_path):
    path = make_tiny_model(str(tmp_path / "llama"), "llama")
    config = build_model_config(None, path, None, "float32", torch.device("cpu"), None, 0, False, quantization="int8")
    with pytest.raises(ValueError, match="runs on CPU only"):
        get_model(config, torch.device("cuda"))  # raises before anything touches the device
