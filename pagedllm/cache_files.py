"""Files in pagedllm's on-disk caches (kernel builds, quantized weights): written whole or not at
all, and removed once no process has used them for a while.

Several processes share a cache (an engine core and its workers, two servers, two test
workers), so a file is made under a temporary name beside its target and renamed into place: a
reader sees the old file, the new one, or none, never half of one. Removal is safe while a file
is open or mapped: its reader keeps it until it closes it."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def write_atomically(target: Path, write: Callable[[str], object], *, temp_prefix: str,
                     executable: bool = False) -> None:
    """`write(tmp)` fills a temporary file beside `target`, which is then renamed onto it. The
    file gets the mode a plain `open` (or a linker, when `executable`) would give it under the
    process's umask, where mkstemp would make it owner-only: a cache shared by several users
    is readable to them as far as the umask lets it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix, suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, umask_mode(executable))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def umask_mode(executable: bool = False) -> int:
    """The mode a plain `open` (0666) or `mkdir` / a linker (0777, `executable`) gives a new
    entry under the process's umask: what every cache entry gets, where mkstemp and mkdtemp
    would make it owner-only."""
    return (0o777 if executable else 0o666) & ~current_umask()


def current_umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for every thread
    meanwhile); 022 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def mark_used(path: Path) -> None:
    """Touch a cache file as it is read, so no process's `prune_stale` takes it while in use.
    A read-only shared cache cannot be touched: its files age, and its owner's writes prune them.
    Raises FileNotFoundError where the file is gone."""
    try:
        os.utime(path)
    except FileNotFoundError:
        raise
    except OSError:
        pass


def prune_stale(directory: Path, pattern: str, max_age_s: float, *, keep: Path | None = None,
                temp_prefix: str | None = None, temp_max_age_s: float = 86400) -> None:
    """Remove the files matching `pattern` not modified for `max_age_s` (a reader that marks its
    use with a touch keeps a file alive), except `keep`; temporary files (`temp_prefix`) a killed writer left
    go after `temp_max_age_s`. A file another process removed first, or one not ours to
    remove (a read-only shared cache), is left alone."""
    now = time.time()
    for entry in directory.glob(pattern):
        if keep is not None and entry == keep:
            continue
        is_temp = temp_prefix is not None and entry.name.startswith(temp_prefix)
        try:
            if entry.stat().st_mtime < now - (temp_max_age_s if is_temp else max_age_s):
                entry.unlink()
        except OSError:
            continue
