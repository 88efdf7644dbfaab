"""The package logger (vLLM's line format, PAGEDLLM_LOGGING_LEVEL), the GGUF conversion's
first-start and cache-reuse lines, and `pagedllm collect-env`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

LINE = re.compile(r"^(INFO|DEBUG|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[[^]]+:\d+\] ")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_log_lines_have_vllms_format_and_follow_the_level_variable():
    code = ("import logging, pagedllm; log = logging.getLogger('pagedllm.test');"
            "log.debug('dbg'); log.info('inf'); log.warning('wrn')")
    lines = _run(code).stderr.splitlines()
    assert [line.split()[-1] for line in lines] == ["inf", "wrn"]
    assert all(LINE.match(line) and "[<string>:1]" in line for line in lines), lines
    assert [line.split()[-1] for line in _run(code, PAGEDLLM_LOGGING_LEVEL="debug").stderr.splitlines()] == [
        "dbg", "inf", "wrn"]
    assert [line.split()[-1] for line in _run(code, PAGEDLLM_LOGGING_LEVEL="WARNING").stderr.splitlines()] == [
        "wrn"]


def test_gguf_conversion_says_first_start_and_then_reuse(tmp_path: Path, capsys):
    from pagedllm.transformers_utils.gguf_loader import convert_gguf
    from tests.model_executor.loader.test_gguf_loader import _write_tiny_gguf

    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, "llama")
    out = convert_gguf(str(src), cache_dir=str(tmp_path / "cache"))
    first = capsys.readouterr().err
    assert f"first start only: cached in {out}" in first and "GGUF conversion took" in first, first
    assert "Dequantizing" not in first  # the weights stay in the GGUF: nothing is converted
    assert convert_gguf(str(src), cache_dir=str(tmp_path / "cache")) == out
    second = capsys.readouterr().err
    assert f"reusing its conversion cached in {out}" in second and "took" not in second, second


@pytest.fixture(scope="module")
def collect_env_output() -> str:
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli.main", "collect-env"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_collect_env_prints_what_a_bug_report_needs(collect_env_output):
    import torch

    from pagedllm import __version__

    rows = dict(line.split(" : ", 1) for line in collect_env_output.splitlines())
    rows = {k.strip(): v for k, v in rows.items()}
    assert rows["pagedllm"] == __version__ and rows["torch"] == torch.__version__
    for name in ("Python", "transformers", "xgrammar", "OS", "CPU model", "CPU cores", "CPU ISA", "Compiler",
                 "C kernels", "CUDA"):
        assert rows.get(name) and not rows[name].startswith("error"), (name, collect_env_output)
    assert rows["xgrammar"] != "not installed"
    for flag in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"):
        assert re.search(rf"\b{flag}=(yes|no)\b", rows["CPU flags"]), rows["CPU flags"]
    assert re.match(r"(AVX-512|AVX2\+FMA|portable C)( \(.*\))? path: |not built|off", rows["C kernels"]), rows
    from pagedllm import cpu_isa
    from pagedllm.model_executor.layers import cpu_kernels

    if cpu_kernels.kernels() is not None:  # the selected level's path is the one named
        assert rows["C kernels"].startswith(cpu_kernels.describe(cpu_isa.selected()))
    assert str(os.cpu_count()) in rows["CPU cores"]
