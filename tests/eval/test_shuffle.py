"""The dinucleotide shuffle keeps every neighbour-pair count, the ends, and samples all such sequences alike."""

from collections import Counter

import numpy as np
import pytest

from genolong.eval.shuffle import dinucleotide_shuffle


def pair_counts(a):
    return Counter(zip(np.asarray(a).tolist()[:-1], np.asarray(a).tolist()[1:]))


@pytest.mark.parametrize("seed", range(5))
def test_every_dinucleotide_count_and_both_ends_are_kept(seed):
    rng = np.random.default_rng(seed)
    seq = rng.choice(5, size=3000, p=[0.3, 0.2, 0.2, 0.25, 0.05]).astype(np.uint8)
    seq[100:140] = 4  # an N run
    out = dinucleotide_shuffle(seq, np.random.default_rng(seed + 100))
    assert out.dtype == seq.dtype and len(out) == len(seq)
    assert pair_counts(out) == pair_counts(seq)
    assert out[0] == seq[0] and out[-1] == seq[-1]
    assert np.mean(out != seq) > 0.5  # really rearranged


def test_seeded_and_different_across_seeds():
    seq = np.random.default_rng(0).integers(0, 4, 500).astype(np.uint8)
    a = dinucleotide_shuffle(seq, np.random.default_rng(1))
    assert np.array_equal(a, dinucleotide_shuffle(seq, np.random.default_rng(1)))
    assert not np.array_equal(a, dinucleotide_shuffle(seq, np.random.default_rng(2)))


@pytest.mark.parametrize("seq", [[], [2], [1, 3], [0, 0, 0, 0], [1, 2, 1, 2, 1], [3, 3, 0, 0, 3]])
def test_short_and_degenerate_sequences(seq):
    seq = np.asarray(seq, dtype=np.uint8)
    out = dinucleotide_shuffle(seq, np.random.default_rng(0))
    assert pair_counts(out) == pair_counts(seq) and sorted(out.tolist()) == sorted(seq.tolist())


def all_with_pair_counts(first, pairs, length):
    """Every sequence of `length` starting with `first` that uses the pair multiset exactly."""
    if length == 1:
        return [(first,)] if not +pairs else []
    out = []
    for (a, b), n in list(pairs.items()):
        if a == first and n > 0:
            pairs[(a, b)] -= 1
            out += [(first,) + rest for rest in all_with_pair_counts(b, pairs, length - 1)]
            pairs[(a, b)] += 1
    return out


def test_samples_uniformly_among_sequences_with_the_same_pair_counts():
    """Enumerate every sequence with the pair counts and first letter of a short one (the last
    letter follows); the shuffle must hit each about equally often (Kandel et al.: uniform)."""
    seq = np.array([0, 1, 0, 2, 1, 0, 1, 2, 0])  # 15 such sequences
    valid = set(all_with_pair_counts(0, pair_counts(seq), len(seq)))
    assert tuple(seq.tolist()) in valid and len(valid) == 15
    rng = np.random.default_rng(0)
    draws = 300 * len(valid)
    hits = Counter(tuple(dinucleotide_shuffle(seq, rng).tolist()) for _ in range(draws))
    assert set(hits) == valid  # nothing else, and every one of them
    # Each count ~ Binomial(draws, 1/len): mean 300, sd ~17; 5 sd either side.
    assert min(hits.values()) > 300 - 90 and max(hits.values()) < 300 + 90
