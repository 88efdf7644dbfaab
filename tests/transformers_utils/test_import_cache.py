"""transformers' import-structure scan, cached on disk: a later process reads the saved structure
instead of scanning, gets exactly what a scan gives, and scans again once a file below the
folder changes, appears, or the saved file is damaged."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagedllm.transformers_utils import import_cache


def test_round_trip_keeps_the_types():
    structure = {
        "albert": {frozenset(): {"configuration_albert": {"AlbertConfig"}},
                   frozenset({"tokenizers", "torch"}): {"tokenization": {"A", "B"}}},
        frozenset({"torch"}): {"modeling": set()},
        "t": ("x", "y"),
    }
    text = json.dumps(import_cache.encode(structure))
    assert import_cache.decode(json.loads(text)) == structure


def _fake_scan(calls: list[str], holder: dict):
    """Shaped like transformers' scan: lru_cache'd, and recursing through the module-level name
    (here `holder["scan"]`), which the cache replaces."""

    @functools.lru_cache
    def scan(path: str):
        calls.append(os.path.basename(path))
        out: dict = {}
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_dir():
                out[entry.name] = holder["scan"](entry.path)
            elif entry.name.endswith(".py") and entry.name != "__init__.py":
                with open(entry.path) as f:
                    out.setdefault(frozenset({"torch"}), {})[entry.name[:-3]] = set(f.read().split())
        return out

    return scan


def _new_process_scan(calls: list[str]):
    holder: dict = {}
    holder["scan"] = import_cache._cached_scan(_fake_scan(calls, holder))
    return holder["scan"]


def test_a_later_process_reads_the_saved_structure(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "models"
    (root / "albert").mkdir(parents=True)
    (root / "albert" / "configuration_albert.py").write_text("AlbertConfig")
    (root / "bert.py").write_text("BertModel BertConfig")
    (root / "__init__.py").write_text("")
    calls: list[str] = []
    first = _new_process_scan(calls)(str(root / "__init__.py"))  # a file means its folder, as in transformers
    assert calls == ["models", "albert"] and first["albert"]
    assert len(list((tmp_path / "cache" / "transformers_imports").glob("*.json"))) == 1

    calls.clear()
    assert _new_process_scan(calls)(str(root)) == first and calls == []

    (root / "albert" / "configuration_albert.py").write_text("AlbertConfig AlbertTextConfig")
    changed = _new_process_scan(calls)(str(root))
    assert calls == ["models", "albert"] and changed["albert"][frozenset({"torch"})]["configuration_albert"] == {
        "AlbertConfig", "AlbertTextConfig"}

    calls.clear()
    (root / "gpt2").mkdir()
    (root / "gpt2" / "modeling_gpt2.py").write_text("GPT2Model")
    assert "gpt2" in _new_process_scan(calls)(str(root)) and calls

    for saved in (tmp_path / "cache" / "transformers_imports").glob("*.json"):
        saved.write_text("{not json")
    calls.clear()
    assert "gpt2" in _new_process_scan(calls)(str(root)) and calls


def test_real_transformers_imports_from_the_saved_structure(tmp_path):
    """Three fresh interpreters: one scans transformers' models folder with no cache installed
    (the reference); the next saves the scan; the last never runs it, and what it read equals
    the reference."""
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path / "cache")}
    reference = textwrap.dedent("""
        import json, os
        import transformers.utils.import_utils as iu  # before pagedllm: nothing is patched
        scan = iu.create_import_structure_from_path
        assert not getattr(scan, "_pagedllm_cached", False)
        models = os.path.normpath(os.path.join(os.path.dirname(iu.__file__), "..", "models"))
        structure = scan(models)
        from pagedllm.transformers_utils.import_cache import encode
        print(json.dumps(encode(structure)))
    """)
    script = textwrap.dedent("""
        import json, os, sys
        import pagedllm  # installs the cache before transformers loads
        from transformers import AutoConfig, PretrainedConfig
        import transformers.utils.import_utils as iu
        from pagedllm.transformers_utils.import_cache import decode
        cached = iu.create_import_structure_from_path
        assert cached._pagedllm_cached
        print(cached.cache_info().misses)
        if sys.argv[1] == "check":
            models = os.path.normpath(os.path.join(os.path.dirname(iu.__file__), "..", "models"))
            with open(sys.argv[2]) as f:
                assert cached(models) == decode(json.load(f))
            assert cached.cache_info().misses == 0
            assert AutoConfig.for_model("llama").model_type == "llama"
    """)
    ref = subprocess.run([sys.executable, "-c", reference], env=env, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    (tmp_path / "reference.json").write_text(ref.stdout)
    assert not (tmp_path / "cache" / "transformers_imports").exists()  # the reference saved nothing
    runs = [subprocess.run([sys.executable, "-c", script, arg, str(tmp_path / "reference.json")], env=env,
                           capture_output=True, text=True, timeout=300) for arg in ("save", "check")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert int(runs[0].stdout.split()[0]) > 100  # the first process scanned the models folders
    assert int(runs[1].stdout.split()[0]) == 0  # the second read them
    assert list((tmp_path / "cache" / "transformers_imports").glob("*.json"))


@pytest.mark.parametrize("bad", ["null", "[1, 2]", '{"d": [[{"s": ["x"]}, "y"]]}', "{not json"])
def test_a_damaged_saved_structure_is_scanned_again(tmp_path, monkeypatch, bad):
    """Saved files of the wrong shape (valid JSON that is not a structure, or not JSON at all)."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "a.py").write_text("A B")
    calls: list[str] = []
    first = _new_process_scan(calls)(str(tmp_path / "models"))
    for saved in (tmp_path / "cache" / "transformers_imports").glob("*.json"):
        saved.write_text(bad)
    calls.clear()
    assert _new_process_scan(calls)(str(tmp_path / "models")) == first and calls == ["models"]


def test_a_damaged_cache_never_stops_the_import(tmp_path):
    """With real transformers in fresh interpreters: a saved file of a structure's look but the
    wrong shape, and transformers still imports, scanning as without the cache."""
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path / "cache")}
    script = "import pagedllm\nfrom transformers import AutoConfig\nprint(AutoConfig.for_model('llama').model_type)"
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    for saved in (tmp_path / "cache" / "transformers_imports").glob("*.json"):
        saved.write_text('{"d": [[{"s": ["x"]}, "y"]]}')
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "llama", run.stderr[-3000:]


def test_the_wrapper_keeps_the_lru_cache_api(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "a.py").write_text("A")
    calls: list[str] = []
    scan = _new_process_scan(calls)
    scan(str(tmp_path / "models"))
    assert scan.cache_info().misses == 1
    scan.cache_clear()
    calls.clear()
    scan(str(tmp_path / "models"))  # the memo is gone: read from disk this time, not scanned
    assert calls == [] and scan.cache_info().misses == 0
