"""Bootstrap over windows: coverage, the unit of resampling, pairing, reproducibility."""

import numpy as np
import pytest

from genolong.eval import stats


def test_weights_are_draws_of_w_windows_and_reproducible():
    a = stats.bootstrap_weights(17, 300, seed=5)
    assert a.shape == (300, 17)
    assert np.all(a.sum(axis=1) == 17)
    assert np.array_equal(a, stats.bootstrap_weights(17, 300, seed=5))
    assert not np.array_equal(a, stats.bootstrap_weights(17, 300, seed=6))
    # each window is drawn once per replicate on average
    assert a.mean() == pytest.approx(1.0, abs=0.02)


def _windows(rng, n_windows, tokens=200, spread=0.3):
    """Per-window sums/counts where windows differ in their mean (like genomic regions) by `spread`."""
    means = 2.0 + spread * rng.standard_normal(n_windows)
    losses = means[:, None] + 0.5 * rng.standard_normal((n_windows, tokens))
    return losses.sum(axis=1), np.full(n_windows, tokens)


def test_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    hits = 0
    trials = 200
    for t in range(trials):
        sums, counts = _windows(rng, 40)
        reps = stats.replicate_means(sums[:, None], counts[:, None], stats.bootstrap_weights(40, 400, seed=t))
        lo, hi = stats.percentile_interval(reps)
        hits += bool(lo[0] <= 2.0 <= hi[0])
    # percentile bootstrap with 40 windows under-covers slightly; far outside this band is a bug
    assert 0.85 <= hits / trials <= 0.99


def test_windows_not_tokens_are_resampled():
    """With correlated tokens the interval must reflect between-window spread, not token count."""
    rng = np.random.default_rng(1)
    sums, counts = _windows(rng, 30, tokens=5000, spread=0.3)
    reps = stats.replicate_means(sums[:, None], counts[:, None], stats.bootstrap_weights(30, 1000, seed=0))
    lo, hi = stats.percentile_interval(reps)
    width = hi[0] - lo[0]
    window_se = 0.3 / np.sqrt(30)  # the truth: the spread of window means dominates
    token_se = 0.5 / np.sqrt(30 * 5000)  # what a token-level bootstrap would claim
    assert width == pytest.approx(2 * 1.96 * window_se, rel=0.35)
    assert width > 20 * 2 * 1.96 * token_se


def test_paired_relative_change_is_exact_when_every_window_changes_alike():
    rng = np.random.default_rng(2)
    sums, counts = _windows(rng, 25)
    w = stats.bootstrap_weights(25, 200, seed=0)
    base = stats.replicate_means(sums[:, None], counts[:, None], w)
    new = stats.replicate_means(0.95 * sums[:, None], counts[:, None], w)
    rel = stats.relative_change(new, base)
    lo, hi = stats.percentile_interval(rel)
    assert lo[0] == pytest.approx(-0.05) and hi[0] == pytest.approx(-0.05)


def test_empty_buckets_give_nan_not_errors():
    sums = np.array([[1.0, 0.0], [2.0, 0.0]])
    counts = np.array([[1, 0], [1, 0]])
    assert np.isnan(stats.ratio(sums, counts)[1])
    reps = stats.replicate_means(sums, counts, stats.bootstrap_weights(2, 50, seed=0))
    lo, hi = stats.percentile_interval(reps)
    assert np.isnan(lo[1]) and np.isnan(hi[1])
    assert 1.0 <= lo[0] <= hi[0] <= 2.0
