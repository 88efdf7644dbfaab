"""Prompt-lookup drafts: if the sequence's last n tokens appeared before, propose what followed.

No model and no forward pass: on repetitive text (editing, quoting, code) the target then
verifies several tokens per forward pass.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int] | np.ndarray) -> list[int]:
        """The tokens after the most recent earlier occurrence of the longest matching suffix
        n-gram (max_n down to min_n); [] if none matches."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        num = len(tokens)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. num - n - 1: each has at least one token after it.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[num - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + self.k].tolist()
        return []
