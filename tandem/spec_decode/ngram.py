"""N-gram (prompt lookup) proposer: the request's own tokens predict its continuation.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens are looked up
earlier in the request (prompt and output); at the latest earlier occurrence that k known
tokens follow (else the earliest one), the tokens that followed it are the draft::

    tokens:  ... a b c d e ... x y a b c | (now)        n = 3: suffix "a b c"
                 ^^^^^ match   ^^^^^ the next k tokens "d e ..." are the draft

numpy only, one pass of vectorised comparisons per n; nothing on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tandem.spec_decode.proposer import ProposerState


def ngram_draft(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The draft for one token sequence (see the module docstring); [] when nothing
    matches."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that start before the suffix itself: [0, length - n).
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            # The latest occurrence followed by k known tokens, else the earliest one.
            full = hits[hits + n + k <= length - 1]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    """Prompt lookup over each request's tokens (see the module docstring)."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, states: Sequence[ProposerState]) -> list[list[int]]:
        k = self.num_speculative_tokens
        return [
            ngram_draft(np.asarray(s.token_ids, dtype=np.int64), k, self.min_n, self.max_n)
            for s in states
        ]
