"""An engine-core process started ahead of its arguments (`pagedllm serve` starts it before
its own imports): the next single-engine AsyncLLM takes it and runs on it, data parallel stops
it, and one nobody takes exits and leaves nothing behind."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine import core_launch
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_launch import discard_prestarted_core, prestart_core, take_prestarted_core

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def fresh_tmpdir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path
    discard_prestarted_core()


def _ipc_dirs(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("pagedllm-"))


def _prestarted_pid() -> int:
    prestart_core()
    return core_launch._prestarted.proc.pid


def test_the_next_engine_runs_on_the_prestarted_core(tiny_llama, fresh_tmpdir):
    pid = _prestarted_pid()
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory=1 << 24))
    try:
        assert engine.client.proc.pid == pid and take_prestarted_core() is None

        async def run():
            return [out async for out in engine.generate([5, 6, 7], GREEDY, "r")][-1]

        assert len(asyncio.run(run()).outputs[0].token_ids) == 4
    finally:
        engine.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not _ipc_dirs(fresh_tmpdir)


def test_a_bad_argument_stops_the_prestarted_core(tiny_llama, fresh_tmpdir):
    """The core already has its arguments when the front's own config finds them bad."""
    pid = _prestarted_pid()
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", max_num_seqs=0))
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not _ipc_dirs(fresh_tmpdir) and take_prestarted_core() is None


def test_an_untaken_core_exits_and_leaves_nothing(fresh_tmpdir):
    prestart_core()
    core = take_prestarted_core()
    assert core is not None and core.is_alive() and _ipc_dirs(fresh_tmpdir)
    core.proc.stdin.close()  # the front went away without arguments: the core exits by itself,
    assert core.proc.wait(120) == 0
    assert not _ipc_dirs(fresh_tmpdir)  # and removes the IPC directory a killed front would leave
    core.close()

    pid = _prestarted_pid()
    discard_prestarted_core()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not _ipc_dirs(fresh_tmpdir) and take_prestarted_core() is None


def test_the_command_line_starts_without_torch():
    """What lets `pagedllm serve` start its core first: importing the CLI does not import torch."""
    code = "import sys, pagedllm.entrypoints.cli.main; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
