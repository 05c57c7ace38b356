"""Exact k-mer matches inside a window: where did the bases just read occur before?

A model can use distant context on DNA mostly by copying: when the k bases before a target also
occurred earlier in the window, the base that followed them there is a strong guess for the
target. `previous_occurrence` finds, for every position, the most recent earlier end of the
same k-mer. Two users:

- `genolong reach` counts how many targets such a copier could predict from context beyond a
  given distance (the ceiling of a long-range gain, per genome, before any GPU time is spent);
- `finetune --copy-oracle K` hands each query the pool holding that earlier base (the copy
  curriculum, genolong/train/copy_oracle.py).

Only exact matches of k N-free bases count; k up to 31 (a k-mer packs into 62 bits).
"""

from __future__ import annotations

import numpy as np

from genolong.errors import GenolongError
from genolong.vocab import N_ID

MAX_K = 31


def kmer_codes(tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes int64 [n], valid bool [n]): the 2-bit packed k-mer *ending* at each position; valid
    where all k bases exist (position >= k-1) and none is N. Tokens are DNA ids (A C G T N = 0-4)."""
    if not 1 <= k <= MAX_K:
        raise GenolongError(f"k-mer length must be in 1..{MAX_K}, got {k}")
    tokens = np.asarray(tokens)
    n = tokens.shape[0]
    is_n = tokens == N_ID
    base = np.where(is_n, 0, tokens).astype(np.int64)
    codes = np.zeros(n, dtype=np.int64)
    for i in range(k):
        # The base i places before each end position, shifted into its 2 bits.
        shifted = np.zeros(n, dtype=np.int64)
        shifted[i:] = base[: n - i] if i else base
        codes |= shifted << (2 * i)
    n_count = np.concatenate([[0], np.cumsum(is_n)])
    ends = np.arange(n)
    starts = ends - k + 1
    valid = starts >= 0
    valid[valid] = n_count[ends[valid] + 1] - n_count[starts[valid]] == 0
    return codes, valid


def previous_occurrence(tokens: np.ndarray, k: int) -> np.ndarray:
    """int64 [n]: for each position i, the largest j < i where the same valid k-mer ends (the
    most recent earlier occurrence of the k bases ending at i), or -1."""
    codes, valid = kmer_codes(tokens, k)
    out = np.full(codes.shape[0], -1, dtype=np.int64)
    idx = np.flatnonzero(valid)
    if idx.size < 2:
        return out
    # Sorted by (code, position): an entry's predecessor with the same code is its previous occurrence.
    order = idx[np.lexsort((idx, codes[idx]))]
    same = codes[order[1:]] == codes[order[:-1]]
    out[order[1:][same]] = order[:-1][same]
    return out


def reach_mask(tokens: np.ndarray, k: int, beyond: int) -> np.ndarray:
    """bool [n-1] over targets 1..n-1 (target j is predicted from bases [0, j)): the k bases before
    target j occurred earlier in the window, and their most recent earlier occurrence ends more
    than `beyond` bases before j-1 — a copier could predict j, but not from the last `beyond`
    bases alone (what a context truncated to `beyond` bases removes)."""
    prev = previous_occurrence(tokens, k)[:-1]  # the context k-mer of target j ends at j-1
    ends = np.arange(prev.shape[0])
    return (prev >= 0) & (ends - prev > beyond)
