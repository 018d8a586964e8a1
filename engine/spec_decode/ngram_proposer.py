"""Prompt lookup (vLLM's ngram method): propose what followed the same n tokens before."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """For n from prompt_lookup_max down to prompt_lookup_min: find the latest earlier
    occurrence of the sequence's last n tokens (prompt and output alike) and propose the
    (up to k) tokens that followed it. The longest match wins; the latest among equals,
    since text being copied is usually copied in order."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. len - n - 1: every occurrence but the suffix itself.
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(starts):
                follow = starts[-1] + n
                return tokens[follow:follow + k].tolist()
        return []
