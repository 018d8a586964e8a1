"""Prompt lookup (vLLM's ngram method): propose what followed the same n tokens before."""

import numpy as np


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
        # Where earlier matches of the last n tokens end, for n = 1, 2, ...: each n keeps
        # the ends of n - 1 whose token n back matches too, so the whole sequence is
        # compared once (for the last token) and then only the few candidates.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        best = None
        for n in range(1, min(self.max_n, len(tokens) - 1) + 1):
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[tokens[ends - (n - 1)] == tokens[-n]]
            if not len(ends):
                break
            if n >= self.min_n:
                best = int(ends[-1])  # the latest match of the longest length so far
        if best is None:
            return []
        return tokens[best + 1:best + 1 + k].tolist()
