"""Loading a checkpoint: a vocabulary table (embedding, LM head) is memory-mapped where it is
stored in the model's dtype in a cache that replaces files whole (a copy-on-write map: the file
never changes), and read (and converted) otherwise."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pagedllm.config import build_model_config
from pagedllm.model_executor.loader.model_loader import get_model
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
