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


def test_the_child_s_error_is_raised_at_join_as_itself():
    def fail():
        raise KeyError("missing tensor")

    with pytest.raises(KeyError, match="missing tensor") as info:
        ForkedCall(fail, "failer").join()
    assert "child process of the failer" in info.value.__notes__[0] and "in fail" in info.value.__notes__[0]


def test_an_unpicklable_error_arrives_as_its_text():
    class Local(Exception):  # defined in a function: cannot be pickled
        pass

    def fail():
        raise Local("no way back")

    with pytest.raises(RuntimeError, match=r"(?s)failer failed in its child process.*Local: no way back"):
        ForkedCall(fail, "failer").join()


def test_a_child_that_never_finishes_is_stopped_at_the_timeout():
    call = ForkedCall(lambda: time.sleep(60), "sleeper")
    with pytest.raises(RuntimeError, match="did not finish"):
        call.join(timeout=0.5)
    assert not call._proc.is_alive()


def test_not_from_a_daemonic_process(monkeypatch):
    import multiprocessing

    monkeypatch.setattr(multiprocessing.current_process(), "daemon", True, raising=False)
    assert not fork_available()


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
