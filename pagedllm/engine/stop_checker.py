"""Stop strings over incrementally decoded text."""

from __future__ import annotations


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Look for a stop string that ends inside the newly added text.

    Returns (stop string, length to truncate the text to), or None. Only the tail
    that could contain a new match is searched, so a stop string spanning several
    tokens is found as soon as its last character arrives.
    """
    if not stop or num_new_chars <= 0:
        return None
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (s, idx)
    if best is None:
        return None
    s, idx = best
    return s, idx + len(s) if include_in_output else idx
