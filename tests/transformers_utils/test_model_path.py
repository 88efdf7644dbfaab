"""Hub ids resolve through huggingface_hub's cache (a temporary one here, in the Hub's own layout:
models--org--name/snapshots/<commit>/ with refs/main), offline; a missing model is one clear
error naming where it looked; --revision, --tokenizer, --hf-config-path and --load-format; and
which models resolve from what is already on disk (a front and an engine core may then resolve
one at the same time)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.transformers_utils.model_path import resolve_model_path, resolves_on_disk
from tests.utils import hf_greedy

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def _place(cache: str, repo: str, source: str, commit: str, ref: str | None = "main") -> str:
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(root, "snapshots", commit)
    shutil.copytree(source, snapshot)
    if ref is not None:
        os.makedirs(os.path.join(root, "refs"), exist_ok=True)
        with open(os.path.join(root, "refs", ref), "w") as f:
            f.write(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, tiny_llama, monkeypatch):
    cache = str(tmp_path / "hub")
    _place(cache, "org/tiny", tiny_llama, COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_from_the_cache_offline(hub, tiny_llama):
    llm = LLM("org/tiny", dtype="float32", kv_cache_memory=1 << 24)
    assert llm.llm_engine.config.model_config.model_path.endswith(os.path.join("snapshots", COMMIT))
    tok = llm.get_tokenizer()
    ids = tok("Hello, my name is").input_ids
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_llama, [ids], 6)[0]["tokens"]


def test_revision_and_download_dir(tmp_path, tiny_llama, tiny_gemma3, monkeypatch):
    cache = str(tmp_path / "elsewhere")
    _place(cache, "org/tiny", tiny_llama, COMMIT)
    _place(cache, "org/tiny", tiny_gemma3, OTHER, ref=None)  # a commit no branch names
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main = EngineArgs("org/tiny", download_dir=cache).create_engine_config().model_config
    pinned = EngineArgs("org/tiny", download_dir=cache, revision=OTHER).create_engine_config().model_config
    assert main.architecture == "LlamaForCausalLM" and pinned.architecture == "Gemma3ForCausalLM"


def test_missing_model_is_one_clear_error(hub):
    with pytest.raises(ValueError, match=r"'org/absent' \(revision main\) is not a local directory and not in "
                                         r"the Hugging Face cache at .*hub; HF_HUB_OFFLINE is set"):
        EngineArgs("org/absent").create_engine_config()
    with pytest.raises(ValueError, match="revision v9"):
        EngineArgs("org/tiny", revision="v9").create_engine_config()
    with pytest.raises(ValueError, match="does not exist: give an HF-style directory"):
        EngineArgs("no/such/dir").create_engine_config()


def test_tokenizer_and_config_from_the_hub(hub, tmp_path, tiny_llama):
    bare = str(tmp_path / "weights_only")
    os.makedirs(bare)
    shutil.copy(os.path.join(tiny_llama, "model.safetensors"), bare)
    shutil.copy(os.path.join(tiny_llama, "config.json"), bare)  # AutoConfig needs one here too
    config = EngineArgs(bare, tokenizer="org/tiny", hf_config_path="org/tiny").create_engine_config()
    assert config.model_config.tokenizer.endswith(COMMIT)
    llm = LLM(bare, tokenizer="org/tiny", dtype="float32", kv_cache_memory=1 << 24)
    assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text is not None


def test_load_format_pt_and_dummy(tmp_path, tiny_llama):
    from safetensors.torch import load_file

    pt_dir = str(tmp_path / "pt")
    shutil.copytree(tiny_llama, pt_dir)
    state = load_file(os.path.join(pt_dir, "model.safetensors"))
    torch.save(state, os.path.join(pt_dir, "pytorch_model.bin"))
    os.remove(os.path.join(pt_dir, "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24).generate("Hello", params, use_tqdm=False)
    for fmt in ("auto", "pt"):
        got = LLM(pt_dir, dtype="float32", kv_cache_memory=1 << 24, load_format=fmt).generate(
            "Hello", params, use_tqdm=False)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    dummy = LLM(tiny_llama, dtype="float32", kv_cache_memory=1 << 24, load_format="dummy")
    model = dummy.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
    norm = model.model.layers[0].input_layernorm.weight
    assert 0 < float(norm.abs().max()) <= 1e-3  # random and small, not the checkpoint's ones
    assert len(dummy.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineArgs(tiny_llama, load_format="tensorflow").create_engine_config()
    with pytest.raises(Exception, match="no \\*.safetensors"):
        LLM(pt_dir, load_format="safetensors", kv_cache_memory=1 << 24)


def test_what_resolves_on_disk(hub, tmp_path, tiny_llama, monkeypatch):
    from tests.model_executor.loader.test_gguf_loader import _write_tiny_gguf

    assert resolves_on_disk(tiny_llama)
    assert EngineArgs(model=tiny_llama).resolves_on_disk()
    assert not EngineArgs(model=tiny_llama, tokenizer="org/tiny").resolves_on_disk()  # a Hub id
    assert not EngineArgs(model=tiny_llama, speculative_config={"method": "ngram"}).resolves_on_disk()
    assert not EngineArgs(model=tiny_llama, trust_remote_code=True).resolves_on_disk()
    assert not EngineArgs(model=None, runner="pooling").resolves_on_disk()  # the packaged model, extracted once
    assert not resolves_on_disk("org/tiny")  # a Hub id, even one in the cache
    assert not resolves_on_disk(str(tmp_path))  # a directory without config.json
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, "llama")
    assert not resolves_on_disk(str(src))  # not converted yet
    out = resolve_model_path(str(src))
    assert resolves_on_disk(str(src))
    # The conversion is the config and tokenizer; the weights are read from the GGUF at every start.
    assert os.path.isfile(os.path.join(out, "config.json"))
    assert not [f for f in os.listdir(out) if f.endswith((".safetensors", ".bin", ".pt"))]
    src.unlink()
    assert not resolves_on_disk(str(src))  # nothing to read the weights from
