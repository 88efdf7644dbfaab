"""The cache files' write (whole or not at all, readable by other users) and prune (by age, the
current file and temporary leftovers apart)."""

from __future__ import annotations

import os
import stat
import time

import pytest

from pagedllm.cache_files import current_umask, mark_used, prune_stale, write_atomically


def _age(path, days: float) -> None:
    t = time.time() - days * 86400
    os.utime(path, (t, t))


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_write_is_renamed_into_place_with_the_umask_mode(tmp_path, umask_027):
    target = tmp_path / "sub" / "a.bin"
    seen = []

    def write(tmp):
        seen.append(tmp)
        assert not target.exists() and os.path.dirname(tmp) == str(target.parent)
        with open(tmp, "wb") as f:
            f.write(b"payload")

    if os.path.exists("/proc/self/status"):  # elsewhere it is assumed, not read
        assert current_umask() == 0o027
    write_atomically(target, write, temp_prefix=".tmp-", executable=True)
    assert target.read_bytes() == b"payload" and stat.S_IMODE(target.stat().st_mode) == 0o777 & ~current_umask()
    assert os.path.basename(seen[0]).startswith(".tmp-") and not os.path.exists(seen[0])
    write_atomically(target, lambda tmp: open(tmp, "wb").write(b"new"), temp_prefix=".tmp-")
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o666 & ~current_umask()


def test_mark_used_keeps_a_file_from_the_prune(tmp_path):
    used = tmp_path / "used.so"
    used.write_bytes(b"x")
    _age(used, 3)
    mark_used(used)
    prune_stale(tmp_path, "*.so", 2 * 86400)
    assert used.exists()
    with pytest.raises(FileNotFoundError):
        mark_used(tmp_path / "gone.so")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "a.bin"
    target.write_bytes(b"old")

    def fail(tmp):
        open(tmp, "wb").write(b"half")
        raise RuntimeError("compiler failed")

    with pytest.raises(RuntimeError, match="compiler failed"):
        write_atomically(target, fail, temp_prefix=".tmp-")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_prune_by_age_keeping_the_current_file(tmp_path):
    files = {name: tmp_path / name for name in ("old.so", "recent.so", "current.so", ".tmp-dead.so",
                                                 ".tmp-live.so", "other.txt")}
    for name, days in (("old.so", 3), ("recent.so", 1), ("current.so", 9), (".tmp-dead.so", 2),
                       (".tmp-live.so", 0.5), ("other.txt", 9)):
        files[name].write_bytes(b"x")
        _age(files[name], days)
    prune_stale(tmp_path, "*.so", 2 * 86400, keep=files["current.so"], temp_prefix=".tmp-")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-live.so", "current.so", "other.txt", "recent.so"]
    prune_stale(tmp_path / "missing", "*.so", 0)  # nothing to do is not an error
