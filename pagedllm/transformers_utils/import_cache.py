"""An on-disk cache for transformers' import-structure scan.

`import transformers` and the first import from `transformers.models` each walk the whole
`models/` tree (560 folders, ~2,600 files in transformers 5.24, every file read and searched for
`__all__`), and the scan's in-memory cache (128 entries) is too small for the second walk to
reuse the first: ~0.6 s of CPU per process, in the front and in the engine core alike, on every
start.

`install()` (run by `import pagedllm`) hooks the scan as `transformers.utils.import_utils` loads:
a folder's structure is kept in memory for the process, and the outermost call's result is saved
under the cache root, keyed by the transformers version, the scan's own source file, and the
names of the folders and the name, size and modification time of every Python file below. Any
change there (an upgrade, an edited checkout) makes a new key; the stat walk costs ~20 ms. The
file is JSON, not pickle: the cache directory may be shared, and reading it must not run code.
Whatever goes wrong with the cache, the scan runs as it would without it; a transformers without
the scan, or with one of another shape, is left alone."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

from pagedllm import envs

MODULE = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"
FORMAT = 1  # bump when the saved form changes
MAX_AGE_S = 30 * 86400  # entries of transformers versions not used for a month go
_TEMP_PREFIX = ".tmp-imports-"


def cache_dir() -> Path:
    return envs.cache_root() / "transformers_imports"


def install() -> None:
    """Cache the scan from now on: at once if transformers is already imported, else when
    its `import_utils` module loads."""
    module = sys.modules.get(MODULE)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def patch(module: Any) -> bool:
    """Wrap the module's scan; False where it has no scan of the expected shape."""
    original = getattr(module, FUNCTION, None)
    if not callable(getattr(original, "__wrapped__", None)) or getattr(original, "_pagedllm_cached", False):
        return False  # not the lru_cache'd function this was written against, or patched already
    setattr(module, FUNCTION, _cached_scan(original))
    return True


class _Finder:
    """A meta path finder that finds nothing itself: it wraps the loader of
    `transformers.utils.import_utils` so the scan is patched right after that module runs,
    before transformers' own __init__ calls it. (Its imports wait until then: `import
    pagedllm` stays light.) It stays on `sys.meta_path`, inert once used: removing it while
    another thread's import walks the list could make that import skip a finder."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if self.done or fullname != MODULE:
            return None
        self.done = True
        spec = None
        for finder in list(sys.meta_path):  # the others, in their order, as importlib asks them
            find = getattr(finder, "find_spec", None)
            if finder is not self and find is not None:
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            try:
                patch(module)
            except Exception:  # a cache must never stop transformers from importing
                pass

        loader.exec_module = exec_and_patch
        return spec


def _cached_scan(scan: Any) -> Any:
    """`scan` (the lru_cache'd original) with the memo and the disk cache in front of it; keeps
    its `cache_info` and `cache_clear` (which clears the memo too)."""
    memo: dict[str, Any] = {}
    depth = 0

    @functools.wraps(scan)
    def cached(module_path: Any) -> Any:
        nonlocal depth
        folder = os.fspath(module_path)
        if os.path.isfile(folder):
            folder = os.path.dirname(folder)
        if folder in memo:
            return memo[folder]
        entry = None
        if depth == 0:  # the outermost call: the one whose result is saved
            try:
                entry = _entry(folder, scan)
                result = _load(entry) if entry is not None else None
                if result is not None:
                    _remember(memo, folder, result)  # its subfolders too, as a scan would have
                    return result
            except Exception:  # noqa: BLE001 - any trouble with the cache: scan as without it
                entry = None
        depth += 1
        try:
            result = scan(folder)
        finally:
            depth -= 1
        if entry is not None:
            _save(entry, result)
        memo[folder] = result
        return result

    def cache_clear() -> None:
        memo.clear()
        scan.cache_clear()

    cached.cache_clear = cache_clear
    cached.cache_info = scan.cache_info
    cached._pagedllm_cached = True
    return cached


def _remember(memo: dict[str, Any], folder: str, structure: dict) -> None:
    """A folder's structure holds each subfolder's under the subfolder's name (a str key; the
    folder's own modules sit under frozensets of backends)."""
    memo[folder] = structure
    for key, value in structure.items():
        if isinstance(key, str) and isinstance(value, dict):
            _remember(memo, os.path.join(folder, key), value)


def _entry(folder: str, scan: Any) -> Path | None:
    """The cache file for a folder as it is now, scanned by this transformers; None where
    either cannot be read."""
    import hashlib

    version = getattr(sys.modules.get("transformers"), "__version__", "")
    digest = hashlib.blake2b(f"{FORMAT}\0{version}\0{os.path.abspath(folder)}\0".encode(), digest_size=16)
    try:  # the scan's own source: an edited checkout may scan differently
        while hasattr(scan, "__wrapped__"):
            scan = scan.__wrapped__
        st = os.stat(scan.__code__.co_filename)
        digest.update(f"{st.st_size}\0{st.st_mtime_ns}\0".encode())
        _fingerprint(folder, digest)
    except (OSError, AttributeError, UnicodeError, RecursionError):
        return None
    return cache_dir() / f"{digest.hexdigest()}.json"


def _fingerprint(folder: str, digest: Any) -> None:
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name == "__pycache__":
                continue
            if entry.is_dir():
                digest.update(f"d\0{entry.name}\0".encode())
                _fingerprint(entry.path, digest)
                digest.update(b"u\0")
            elif entry.name.endswith(".py"):
                st = entry.stat()
                digest.update(f"f\0{entry.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())


def _load(path: Path) -> Any:
    import json

    from pagedllm.cache_files import mark_used

    try:
        with open(path, encoding="utf-8") as f:
            result = decode(json.load(f))
        mark_used(path)
        return result
    except Exception:  # noqa: BLE001 - unreadable, damaged or of another shape: scanned again
        return None


def _save(path: Path, result: Any) -> None:
    import json

    from pagedllm.cache_files import prune_stale, write_atomically

    try:
        text = json.dumps(encode(result), separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):  # something the JSON form cannot hold: not cached
        return
    try:
        write_atomically(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), temp_prefix=_TEMP_PREFIX)
        prune_stale(path.parent, "*.json", MAX_AGE_S, keep=path)
        prune_stale(path.parent, f"{_TEMP_PREFIX}*", MAX_AGE_S, temp_prefix=_TEMP_PREFIX)
    except Exception:  # noqa: BLE001 - a read-only or full cache: the scan still ran
        pass


def encode(value: Any) -> Any:
    """The structure as JSON: dicts (whose keys are names or frozensets of backends), sets and
    frozensets of names, tuples; each container tagged so `decode` gives back the same types."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return {"d": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, frozenset):
        return {"f": sorted(encode(v) for v in value)}
    if isinstance(value, set):
        return {"s": sorted(encode(v) for v in value)}
    if isinstance(value, tuple):
        return {"t": [encode(v) for v in value]}
    raise TypeError(f"cannot cache a {type(value).__name__}")


def decode(value: Any) -> Any:
    if isinstance(value, str):
        return value
    (tag, items), = value.items()
    if tag == "d":
        return {decode(k): decode(v) for k, v in items}
    if tag == "f":
        return frozenset(decode(v) for v in items)
    if tag == "s":
        return {decode(v) for v in items}
    if tag == "t":
        return tuple(decode(v) for v in items)
    raise ValueError(f"unknown tag {tag!r}")

