import json

import pytest
import torch
from safetensors.torch import load_file

from pagedllm.spec_decode.truncated_draft import make_truncated_draft


def test_keeps_first_and_last_layers_renumbered(tiny_gemma3, tmp_path):
    dst = make_truncated_draft(tiny_gemma3, str(tmp_path / "d"), num_layers=2, keep_last=1)
    src_w = load_file(f"{tiny_gemma3}/model.safetensors")
    dst_w = load_file(f"{dst}/model.safetensors")
    config = json.loads(open(f"{dst}/config.json").read())
    assert config["num_hidden_layers"] == 2
    assert config["layer_types"] == ["sliding_attention", "full_attention"]  # layers 0 and 2 of the target
    name = "model.layers.{}.self_attn.q_proj.weight"
    assert torch.equal(dst_w[name.format(0)], src_w[name.format(0)])
    assert torch.equal(dst_w[name.format(1)], src_w[name.format(2)])
    assert not any(".layers.2." in k for k in dst_w)
    with pytest.raises(ValueError):
        make_truncated_draft(tiny_gemma3, str(tmp_path / "e"), num_layers=3)
