"""N-gram prompt lookup (Saxena, "Prompt Lookup Decoding", 2023; vLLM's ``ngram``
method): draft the tokens that followed an earlier occurrence of the context's
last ``n`` tokens.

    context:  ... a b c d e ... x y a b c          (last n = 3 tokens: a b c)
                      ^^^^^ match, s         suffix
    proposal: d e ...  (up to k tokens after the match)

The longest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` with a match wins;
among its matches, the latest (the most recent context). Pure numpy, no torch.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_propose(token_ids: list[int] | np.ndarray, min_n: int, max_n: int, k: int
                  ) -> list[int]:
    """Propose up to ``k`` draft tokens by prompt lookup.

    Args:
        token_ids: the whole context (prompt + generated), length ``L``.
        min_n, max_n: the n-gram lengths tried, longest first (``1 <= min_n <= max_n``).
        k: the most tokens to propose (``k <= 0`` proposes nothing).

    Returns:
        The tokens that followed the latest earlier occurrence of the longest
        matching suffix n-gram (fewer than ``k`` when the context ends first);
        ``[]`` when no n-gram matches.
    """
    if k <= 0:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    length = arr.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = arr[length - n:]
        # occurrences start at s with s + n <= L - 1: at least one token follows them
        windows = sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []
