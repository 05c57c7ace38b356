"""WindowSampler and tile_windows: determinism, resumption, N handling, strands, tiling."""

import json

import numpy as np
import pytest

from genolong.data import WindowSampler, open_prepared, prepare, tile_windows
from genolong.errors import GenolongError

from .conftest import REFERENCE_IDS, write_text_fasta

COMPLEMENT = {"A": "T", "C": "G", "G": "C", "T": "A", "N": "N"}


def _random_seq(rng, n, alphabet="ACGTacgt"):
    return "".join(rng.choice(list(alphabet), n))


@pytest.fixture(scope="module")
def genome(tmp_path_factory):
    """train: two records of known text (one with an N gap); holdout: mostly-N and clean records."""
    tmp = tmp_path_factory.mktemp("sampler")
    rng = np.random.default_rng(0)
    seqs = {
        "chr1": _random_seq(rng, 3000),
        "chr2": _random_seq(rng, 2000) + "N" * 3000 + _random_seq(rng, 4000),
        "chr3": "N" * 900 + _random_seq(rng, 100),
        "chr4": _random_seq(rng, 1030),
        "chrN": "N" * 500,
    }
    fasta = write_text_fasta(tmp / "g.fa", list(seqs.items()), width=57)
    out = prepare(
        fasta,
        tmp / "out",
        train="chr1,chr2",
        holdout="chr3,chr4",
        validation="chrN",
        progress=False,
        log=lambda m: None,
    )
    return open_prepared(out), seqs


def _expected(seqs, w):
    text = seqs[w.record][w.start : w.start + w.tokens.size]
    if w.reverse:
        text = "".join(COMPLEMENT[c.upper()] for c in reversed(text))
        mask = [c.islower() for c in reversed(seqs[w.record][w.start : w.start + w.tokens.size])]
    else:
        mask = [c.islower() for c in text]
    return [REFERENCE_IDS[c.upper()] for c in text], mask


def _take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_windows_are_slices_of_the_source_and_reproducible(genome):
    pg, seqs = genome
    a = _take(WindowSampler(pg, "train", 256, seed=7, reverse_complement=True), 40)
    b = _take(WindowSampler(pg, "train", "256", seed=7, reverse_complement=True), 40)
    c = _take(WindowSampler(pg, "train", 256, seed=8, reverse_complement=True), 40)
    assert [(w.record, w.start, w.reverse) for w in a] == [(w.record, w.start, w.reverse) for w in b]
    assert [(w.record, w.start) for w in a] != [(w.record, w.start) for w in c]
    assert {w.reverse for w in a} == {True, False}
    for w in a:
        tokens, mask = _expected(seqs, w)
        assert w.tokens.dtype == np.uint8 and w.repeat_mask.dtype == np.bool_
        assert w.tokens.tolist() == tokens and w.repeat_mask.tolist() == mask


def test_resuming_from_state_dict_continues_the_stream(genome):
    pg, _ = genome
    uninterrupted = _take(WindowSampler(pg, "train", "1k", seed=3, reverse_complement=True), 12)
    first = WindowSampler(pg, "train", "1k", seed=3, reverse_complement=True)
    _take(first, 7)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = WindowSampler(pg, "train", "1k", seed=3, reverse_complement=True)
    resumed.load_state_dict(state)
    rest = _take(resumed, 5)
    for w, u in zip(rest, uninterrupted[7:], strict=True):
        assert (w.record, w.start, w.reverse) == (u.record, u.start, u.reverse)
        assert np.array_equal(w.tokens, u.tokens)
    other = WindowSampler(pg, "train", "1k", seed=4)
    with pytest.raises(GenolongError, match="seed=3"):
        other.load_state_dict(state)


def test_ranks_split_one_stream(genome):
    pg, _ = genome
    single = [(w.record, w.start) for w in _take(WindowSampler(pg, "train", 100, seed=1), 10)]
    r0 = [(w.record, w.start) for w in _take(WindowSampler(pg, "train", 100, seed=1, rank=0, world_size=2), 5)]
    r1 = [(w.record, w.start) for w in _take(WindowSampler(pg, "train", 100, seed=1, rank=1, world_size=2), 5)]
    assert single[0::2] == r0 and single[1::2] == r1


def test_starts_are_uniform_over_all_windows(genome):
    pg, _ = genome
    windows = _take(WindowSampler(pg, "train", 1000, seed=0, max_n_fraction=1.0), 1500)
    # chr1 has 2001 window starts; chr2 8001, of which the 2001 inside its N gap are all N and redrawn:
    # chr1 should get 2001 / (2001 + 6000) = 25% of windows (not 50%, not 3000 / 12000 by length alone).
    share = sum(w.record == "chr1" for w in windows) / len(windows)
    assert 0.22 < share < 0.28
    assert max(w.start for w in windows if w.record == "chr2") > 7000


def test_n_fraction_limit_and_never_all_n(genome):
    pg, seqs = genome
    for w in _take(WindowSampler(pg, "train", 500, seed=2, max_n_fraction=0.1), 100):
        assert np.mean(w.tokens == 4) <= 0.1
    # holdout chr3 is 90% N: most 100-base windows of it are all N, and none may come out.
    windows = _take(WindowSampler(pg, "holdout", 100, seed=2, max_n_fraction=1.0), 300)
    assert all((w.tokens != 4).any() for w in windows)
    assert any(w.record == "chr3" and (w.tokens == 4).any() for w in windows)
    with pytest.raises(GenolongError, match="after 1000 tries") as all_n:
        next(iter(WindowSampler(pg, "validation", 100, seed=0, max_n_fraction=1.0)))
    # The limit is already 1.0: raising it cannot help, so the line does not advise it.
    assert "is (almost) all N" in str(all_n.value) and "max-n-fraction" not in str(all_n.value)
    with pytest.raises(GenolongError, match=r"raise --max-n-fraction \(now 0.1\) or use a shorter --seq"):
        next(iter(WindowSampler(pg, "validation", 100, seed=0, max_n_fraction=0.1)))


def test_impossible_requests_are_refused(genome):
    pg, _ = genome
    with pytest.raises(GenolongError, match="longest is 'chr2' with 9,000"):
        WindowSampler(pg, "train", "512k")
    with pytest.raises(GenolongError, match="split 'test' is not in"):
        WindowSampler(pg, "test", 100)
    with pytest.raises(GenolongError, match="between 0 and 1"):
        WindowSampler(pg, "train", 100, max_n_fraction=1.5)
    with pytest.raises(GenolongError, match="longest is 'chr4'"):
        tile_windows(pg, "holdout", 2000)


def test_tiling_is_ordered_non_overlapping_and_skips_n(genome):
    pg, seqs = genome
    tiles = list(tile_windows(pg, "holdout", 100))
    # chr3: windows 0..8 are all N (skipped), window 9 is clean; chr4: 10 full windows, the 30-base tail dropped.
    assert [(w.record, w.start) for w in tiles] == [("chr3", 900)] + [("chr4", 100 * i) for i in range(10)]
    for w in tiles:
        tokens, mask = _expected(seqs, w)
        assert w.tokens.tolist() == tokens and w.repeat_mask.tolist() == mask and not w.reverse
    train = list(tile_windows(pg, "train", 1000, max_n_fraction=0.5))
    assert [(w.record, w.start) for w in train] == [("chr1", s) for s in (0, 1000, 2000)] + [
        ("chr2", s) for s in (0, 1000, 5000, 6000, 7000, 8000)
    ]
    assert len(list(tile_windows(pg, "train", 1000, max_windows=4))) == 4
