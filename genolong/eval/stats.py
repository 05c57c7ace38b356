"""Bootstrap over windows for per-bucket mean losses and their relative changes.

Tokens of one window are strongly correlated (same region, same repeat families, same GC
content), so resampling tokens would give intervals far too narrow. The unit of resampling is
the window: each replicate draws W windows with replacement, and a bucket's mean is the ratio
sum(loss) / sum(count) over the drawn windows (the same token-weighted estimator as the point
estimate). Replicates are represented as multinomial weights [R, W], so one matrix product
gives every bucket of every replicate, and the baseline and the checkpoint are always
evaluated on the *same* draws (a paired bootstrap: their difference is much tighter than
either interval).
"""

from __future__ import annotations

import warnings

import numpy as np


def bootstrap_weights(n_windows: int, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot, n_windows] counts: how often each window is drawn in each replicate."""
    if n_windows <= 0:
        raise ValueError("bootstrap needs at least one window")
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_windows, np.full(n_windows, 1.0 / n_windows), size=n_boot).astype(np.float64)


def ratio(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """sum / count along axis 0 (windows), NaN where there is nothing to average."""
    total = np.asarray(counts, dtype=np.float64).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, np.asarray(sums).sum(axis=0) / np.where(total > 0, total, 1), np.nan)


def replicate_means(sums: np.ndarray, counts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """sums, counts [W, ...] -> bootstrap means [R, ...] with weights [R, W]."""
    w = sums.shape[0]
    flat_s = sums.reshape(w, -1)
    flat_c = np.asarray(counts, dtype=np.float64).reshape(w, -1)
    num = weights @ np.nan_to_num(flat_s)
    den = weights @ flat_c
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)
    return out.reshape((weights.shape[0],) + sums.shape[1:])


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval over axis 0, NaN-aware (buckets without tokens stay NaN)."""
    alpha = (1.0 - level) / 2.0
    if samples.shape[0] == 0:
        nan = np.full(samples.shape[1:], np.nan)
        return nan, nan.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns (empty buckets) are expected
        lo = np.nanquantile(samples, alpha, axis=0)
        hi = np.nanquantile(samples, 1.0 - alpha, axis=0)
    return lo, hi


def relative_change(new: np.ndarray, base: np.ndarray) -> np.ndarray:
    """(new - base) / base; negative = the new model's loss is lower."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return (new - base) / base
