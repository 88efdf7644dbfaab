"""ForkedCall: the child's work is done by join(), its error (with its traceback) is raised
there, and a child that dies without a word is an error too."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagedllm.transformers_utils.forked_call import ForkedCall, fork_available

pytestmark = pytest.mark.skipif(not fork_available(), reason="fork is Linux-only here")


def test_the_child_s_work_is_done_at_join(tmp_path):
    out = tmp_path / "out.txt"
    call = ForkedCall(lambda: out.write_text(str(os.getpid())), "writer")
    call.join()
    assert out.read_text() != str(os.getpid())  # written by another process


def test_the_child_s_error_is_raised_at_join():
    def fail():
        raise KeyError("missing tensor")

    with pytest.raises(RuntimeError, match=r"(?s)failer failed in its child process.*KeyError: 'missing tensor'"):
        ForkedCall(fail, "failer").join()


def test_a_child_killed_without_a_word_is_an_error():
    call = ForkedCall(lambda: time.sleep(60), "sleeper")
    os.kill(call._proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="exit code -9"):
        call.join()


def test_kill_stops_it():
    call = ForkedCall(lambda: time.sleep(60), "sleeper")
    start = time.monotonic()
    call.kill()
    assert time.monotonic() - start < 10 and not call._proc.is_alive()
