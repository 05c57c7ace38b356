"""Planted repeats: the spec, placement rules, determinism, the training sampler and bit-exact resume."""

import json

import numpy as np
import pytest

from genolong.data import WindowSampler, open_prepared
from genolong.data.planted import (
    PlantedRepeatSampler,
    PlantSpec,
    apply,
    place,
    plant_window,
    window_rng,
)
from genolong.data.sampler import Window
from genolong.errors import GenolongError
from genolong.train import loop
from tests.train._helpers import prepared_genome, tiny_options

from .conftest import assert_one_line_error, run_cli


def _window(n=4000, seed=0, n_runs=((500, 700), (2500, 2510)), record="chrX", start=123):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4, n).astype(np.uint8)
    for a, b in n_runs:
        tokens[a:b] = 4
    mask = rng.random(n) < 0.3
    return Window(tokens, mask, record, start, False)


def test_spec_reads_writes_and_draws():
    spec = PlantSpec.parse("len=64,max-dist=48k,per-window=8")
    assert (spec.length, spec.max_distance, spec.per_window, spec.lowest_distance) == (64, 49152, 8, 64)
    assert PlantSpec.parse(spec.describe()) == PlantSpec.parse("len=64,per-window=8,min-dist=64,max-dist=48k")
    listed = PlantSpec.parse("len=32,dist=100/1k/3000,per-window=50,seed=5")
    assert listed.distances == (100, 1024, 3000) and listed.seed == 5
    assert PlantSpec.parse(listed.describe()) == listed
    drawn = listed.draw_distances(np.random.default_rng(0))
    assert len(drawn) == 50 and set(drawn) == {100, 1024, 3000}
    # Log-uniform: about as many draws in each factor-of-10 band between 100 and 100k.
    wide = PlantSpec(length=16, per_window=20000, min_distance=100, max_distance=100000)
    d = np.array(wide.draw_distances(np.random.default_rng(1)))
    assert d.min() >= 100 and d.max() <= 100000
    bands = np.histogram(np.log10(d), bins=[2, 3, 4, 5])[0] / len(d)
    assert np.allclose(bands, 1 / 3, atol=0.02)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("len=64", "exactly one of max-dist"),
        ("len=64,max-dist=1k,dist=100", "exactly one of max-dist"),
        ("len=64,dist=32/1k", "shorter than len=64"),
        ("len=64,max-dist=1k,min-dist=2k", "below min-dist"),
        ("len=64,maxdist=1k", "cannot read 'maxdist=1k'"),
        ("len=64,max-dist=1k,per-window=0", "must be positive"),
        ("len=64,max-dist=1q", "not a token count"),
        ("len=64,dist=100,min-dist=80", "min-dist goes with max-dist"),
        ("len=64,max-dist=1k,mutate=0.8", "not a substitution rate"),
        ("len=64,max-dist=1k,mutate=-0.1", "not a substitution rate"),
        ("len=64,max-dist=1k,mutate=few", "is not a number"),
    ],
)
def test_bad_specs_are_one_line_errors(text, fragment):
    with pytest.raises(GenolongError, match=fragment):
        PlantSpec.parse(text)


def test_spec_longer_than_the_window_is_refused():
    spec = PlantSpec.parse("len=64,max-dist=2k,per-window=1")
    spec.validate(window=2048 + 65)
    with pytest.raises(GenolongError, match="lower max-dist to at most 1,983"):
        spec.validate(window=2048)


def test_copies_follow_the_rules():
    w = _window()
    distances = [64, 100, 300, 1000, 1000, 2000, 3000, 3400]
    planted = plant_window(w, distances, 40, window_rng(0, w))
    assert sorted(c.distance for c in planted.copies) == sorted(distances)
    spans = sorted((a, a + 40) for c in planted.copies for a in (c.source, c.dest))
    assert all(b <= a2 for (_, b), (a2, _) in zip(spans, spans[1:]))  # pairwise disjoint
    assert spans[0][0] >= 1 and spans[-1][1] <= len(w.tokens)
    expected_tokens, expected_mask = w.tokens.copy(), w.repeat_mask.copy()
    for c in planted.copies:
        src = slice(c.source, c.source + 40)
        dst = slice(c.dest, c.dest + 40)
        assert (w.tokens[src] != 4).all() and (w.tokens[dst] != 4).all()  # no N at either place, before planting
        expected_tokens[dst], expected_mask[dst] = w.tokens[src], w.repeat_mask[src]
    assert np.array_equal(planted.tokens, expected_tokens) and np.array_equal(planted.repeat_mask, expected_mask)
    assert planted.original is w.tokens and not np.shares_memory(planted.tokens, w.tokens)
    assert (planted.record, planted.start, planted.reverse) == (w.record, w.start, w.reverse)


def test_diverged_copies_differ_from_their_sources_at_the_asked_rate():
    """mutate=F: the same places as unmutated copies; every changed base of a copy is another of
    A, C, G, T; the changed share over many copies is F within binomial noise; nothing outside the
    copies changes; and the spec reads and writes the rate."""
    spec = PlantSpec.parse("len=64,dist=200/900/2000,per-window=3,mutate=0.1")
    assert spec.mutate == 0.1 and PlantSpec.parse(spec.describe()) == spec
    assert "mutate" not in PlantSpec.parse("len=64,dist=200,per-window=1").describe()  # unchanged identity without it
    changed = total = 0
    for i in range(200):
        w = _window(seed=i, n_runs=())
        exact = plant_window(w, [200, 900, 2000], 64, window_rng(7, w))
        diverged = plant_window(w, [200, 900, 2000], 64, window_rng(7, w), mutate=0.1)
        assert diverged.copies == exact.copies
        inside = np.zeros(len(w.tokens), bool)
        for c in exact.copies:
            inside[c.dest : c.dest + c.length] = True
        assert np.array_equal(diverged.tokens[~inside], exact.tokens[~inside])
        assert np.array_equal(diverged.repeat_mask, exact.repeat_mask)
        differ = diverged.tokens[inside] != exact.tokens[inside]
        assert diverged.tokens[inside].max() <= 3  # never an N
        changed += int(differ.sum())
        total += int(inside.sum())
    # 200 windows x 3 copies x 64 bases = 38,400 draws: sd of the share ~0.0015.
    assert total == 38400 and abs(changed / total - 0.1) < 0.008


def test_placement_is_a_function_of_seed_and_window_only():
    w = _window()
    again = _window()
    a = plant_window(w, [500, 1500], 64, window_rng(3, w)).copies
    assert a == plant_window(again, [500, 1500], 64, window_rng(3, again)).copies
    assert a != plant_window(w, [500, 1500], 64, window_rng(4, w)).copies
    moved = Window(w.tokens, w.repeat_mask, w.record, w.start + 1, False)
    assert a != plant_window(moved, [500, 1500], 64, window_rng(3, moved)).copies


def test_a_distance_with_no_room_is_left_out():
    w = _window(n=1000, n_runs=())
    copies = place(w.tokens, [990, 900, 100], 64, np.random.default_rng(0))
    # 990 + 64 does not fit in 1000 bases; 900 does (sources in [1, 36]), and 100 fits beside it.
    assert sorted(c.distance for c in copies) == [100, 900]
    all_n = np.full(1000, 4, dtype=np.uint8)
    assert place(all_n, [100], 10, np.random.default_rng(0)) == []
    tokens, mask = apply(all_n, np.zeros(1000, bool), [])
    assert np.array_equal(tokens, all_n)


@pytest.fixture(scope="module")
def genome(tmp_path_factory):
    return prepared_genome(tmp_path_factory.mktemp("planted"))


def _take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_sampler_plants_every_window_and_resumes(genome):
    pg = open_prepared(genome)
    spec = PlantSpec.parse("len=32,max-dist=900,min-dist=100,per-window=6")

    def sampler(seed=1):
        return PlantedRepeatSampler(WindowSampler(pg, "train", 1025, seed=seed, max_n_fraction=0.1, reverse_complement=True), spec, seed=seed)

    straight = _take(sampler(), 10)
    plain = _take(WindowSampler(pg, "train", 1025, seed=1, max_n_fraction=0.1, reverse_complement=True), 10)
    for p, w in zip(straight, plain, strict=True):
        assert (p.record, p.start, p.reverse) == (w.record, w.start, w.reverse)
        assert np.array_equal(p.original, w.tokens)
        assert len(p.copies) >= 5  # at most one of six may find no N-free room in these N-rich windows
        for c in p.copies:
            assert 100 <= c.distance <= 900
            assert np.array_equal(p.tokens[c.dest : c.dest + 32], p.tokens[c.source : c.source + 32])
    first = sampler()
    _take(first, 4)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = sampler()
    resumed.load_state_dict(state)
    for p, q in zip(_take(resumed, 6), straight[4:], strict=True):
        assert np.array_equal(p.tokens, q.tokens) and p.copies == q.copies
    other = PlantedRepeatSampler(WindowSampler(pg, "train", 1025, seed=1, max_n_fraction=0.1, reverse_complement=True), PlantSpec.parse("len=16,max-dist=900,per-window=6"), seed=1)
    with pytest.raises(GenolongError, match="other planted repeats"):
        other.load_state_dict(state)
    with pytest.raises(GenolongError, match="lower max-dist"):
        PlantedRepeatSampler(WindowSampler(pg, "train", 512, seed=1), spec, seed=1)


@pytest.mark.usefixtures("one_thread")
def test_training_on_planted_repeats_resumes_bit_exactly(genome, tmp_path):
    common = {"steps": 4, "seq_len": 512, "warmup": 1, "planted_repeats": "len=32,max-dist=400,per-window=4"}
    straight = loop.train(tiny_options(genome, tmp_path / "a", **common))
    plain = loop.train(tiny_options(genome, tmp_path / "p", **{**common, "planted_repeats": None}))
    assert [r["loss"] for r in straight] != [r["loss"] for r in plain]  # the option changes what is trained on
    first = loop.train(tiny_options(genome, tmp_path / "b", stop_after=2, **common))
    second = loop.train(loop.load_run_options(tmp_path / "b", stop_after=None, progress=False))
    assert [r["loss"] for r in first + second] == [r["loss"] for r in straight]
    assert json.loads((tmp_path / "b" / "options.json").read_text())["planted_repeats"] == common["planted_repeats"]


def test_finetune_refuses_a_bad_spec_in_one_line(genome, tmp_path):
    result = run_cli("finetune", "--data", str(genome), "--seq", "512", "--preset", "tiny", "--out", str(tmp_path / "r"),
                     "--device", "cpu", "--planted-repeats", "len=64,max-dist=1k")
    assert_one_line_error(result, "--planted-repeats", "lower max-dist")
    assert not (tmp_path / "r").exists()
