"""eval-recall's controls: the scrambled source (built without a model), the three passes scored
by a stub whose losses are set by hand, the new columns, and partial files of the older
three-kind format refused rather than mixed in."""

import csv
import io
import json
import math

import numpy as np
import pytest
import torch

from genolong.data.planted import PlantedCopy, PlantedWindow, scramble_sources
from genolong.errors import GenolongError
from genolong.eval.recall import RecallSettings, evaluate, plant_for_eval, score_planted
from genolong.eval.recall_layout import RecallLayout
from genolong.eval.recall_report import aggregate, offsets_csv, summary_text, to_csv, to_json
from genolong.eval.store import PARTIAL_NAME
from genolong.vocab import N_ID
from tests.eval.standins import GRULM, make_windows, scorer, spec

SEQ, LEN, SKIP = 512, 32, 8
DISTANCES = (40, 150, 400)
LN2 = math.log(2)


def _planted(seed: int = 5) -> PlantedWindow:
    w = make_windows(1, SEQ, seed=seed, n_run=False)[0]
    p = plant_for_eval(w, RecallLayout(seq=SEQ, length=LEN, distances=DISTANCES, skip=SKIP), 0)
    assert p is not None and len(p.copies) == 3
    return p


def _in_sources(p: PlantedWindow) -> np.ndarray:
    inside = np.zeros(len(p.tokens), dtype=bool)
    for c in p.copies:
        inside[c.source : c.source + c.length] = True
    return inside


def test_scramble_is_seeded_keeps_composition_and_touches_only_the_sources():
    p = _planted()
    a, unchanged = scramble_sources(p, 0)
    b, _ = scramble_sources(p, 0)
    c, _ = scramble_sources(p, 1)
    np.testing.assert_array_equal(a, b)  # deterministic
    assert unchanged == 0 and not np.array_equal(a, c)  # and the seed matters
    inside = _in_sources(p)
    np.testing.assert_array_equal(a[~inside], p.tokens[~inside])  # the copies and everything else as planted
    assert a.dtype == p.tokens.dtype and len(a) == len(p.tokens)
    text = a.tobytes()
    for cp in p.copies:
        source, shuffled = p.tokens[cp.source : cp.source + LEN], a[cp.source : cp.source + LEN]
        copy = a[cp.dest : cp.dest + LEN]
        np.testing.assert_array_equal(copy, source)  # the copy is untouched ...
        assert not np.array_equal(shuffled, copy)  # ... and its source no longer equals it
        assert np.array_equal(np.bincount(shuffled, minlength=8), np.bincount(source, minlength=8))
        assert N_ID not in shuffled
        # No earlier occurrence of the copy is left in the window.
        assert text.find(copy.tobytes()) == cp.dest
    # The placement's own draws are not disturbed: the planted window is as it was.
    np.testing.assert_array_equal(_planted().tokens, p.tokens)


def test_scramble_of_a_source_with_one_repeated_base_is_counted():
    tokens = np.zeros(SEQ, dtype=np.uint8)  # all A
    tokens[200:232] = np.tile(np.array([0, 1], dtype=np.uint8), 16)  # ACAC...: can be scrambled
    tokens[232] = 2
    copies = (PlantedCopy(10, 40, LEN), PlantedCopy(200, 150, LEN))
    planted = tokens.copy()
    for cp in copies:
        planted[cp.dest : cp.dest + LEN] = tokens[cp.source : cp.source + LEN]
    p = PlantedWindow(planted, np.zeros(SEQ, dtype=bool), "chrT", 0, False, copies, tokens)
    out, unchanged = scramble_sources(p, 0)
    assert unchanged == 1  # the all-A source: no shuffle can change it
    np.testing.assert_array_equal(out[10:42], planted[10:42])
    assert not np.array_equal(out[200:232], planted[200:232])
    assert sorted(out[200:232].tolist()) == [0] * 16 + [1] * 16


# The stub's losses (nats): on the planted window, copy offset o costs COPY[w] + 0.01 o and the
# first occurrence FIRST; the unplanted window NULL everywhere; the scrambled window SCRAMBLED at
# the copy. Everywhere else 9.0, so a base read from the wrong place shows.
COPY, FIRST, NULL, SCRAMBLED = (0.4, 0.8), (1.6, 1.6), (1.2, 1.6), (1.8, 1.6)


class StubScorer:
    def __init__(self, planted: PlantedWindow, w: int, seed: int) -> None:
        self.p, self.w, self.seed = planted, w, seed
        self.passes: list[str] = []

    def token_ids(self, tokens: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(tokens).astype(np.int64))

    def losses(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = ids[0].numpy()
        out = np.full(SEQ - 1, 9.0)  # entry j - 1: target j
        o = np.arange(LEN)
        if np.array_equal(tokens, self.p.tokens):
            self.passes.append("planted")
            for c in self.p.copies:
                out[c.dest + o - 1] = COPY[self.w] + 0.01 * o
                out[c.source + o - 1] = FIRST[self.w]
        elif np.array_equal(tokens, self.p.original):
            self.passes.append("original")
            out[:] = NULL[self.w]
        else:
            self.passes.append("scrambled")
            inside = _in_sources(self.p)
            assert np.array_equal(tokens[~inside], self.p.tokens[~inside]) and not np.array_equal(tokens, self.p.tokens)
            for c in self.p.copies:
                out[c.dest + o - 1] = SCRAMBLED[self.w]
        return torch.from_numpy(out)[None]


def test_three_passes_scored_by_hand():
    layout = RecallLayout(seq=SEQ, length=LEN, distances=DISTANCES, skip=SKIP)
    windows = [_planted(5), _planted(6)]
    scores = []
    for w, p in enumerate(windows):
        stub = StubScorer(p, w, seed=0)
        score = score_planted(stub, p, layout, seed=0)
        assert sorted(stub.passes) == ["original", "planted", "scrambled"]
        o = np.arange(LEN)
        for i in range(len(DISTANCES)):
            np.testing.assert_allclose(score.sums[i, 0], COPY[w] + 0.01 * o)
            np.testing.assert_allclose(score.sums[i, 1:], np.array([FIRST[w], NULL[w], SCRAMBLED[w]])[:, None] * np.ones(LEN))
        assert (score.counts == 1).all()
        scores.append(score)

    keys = [(p.record, int(p.start), bool(p.reverse)) for p in windows]
    res = aggregate(layout, keys, {"m": scores}, {"m": "stub"}, n_boot=400, seed=0, meta={})
    rows = list(csv.DictReader(io.StringIO(to_csv(res))))
    assert list(rows[0]) == [
        "model", "label", "distance", "n_windows", "n_bases",
        *(f"{q}{s}" for q in ("copy_bits", "first_bits", "null_bits", "scrambled_bits", "recall", "recall_null", "recall_scrambled") for s in ("", "_lo", "_hi")),
    ]  # fmt: skip
    # Headline offsets 8..31: mean 0.01 o = 0.195; windows weigh alike (24 bases each).
    copy = (0.4 + 0.195 + 0.8 + 0.195) / 2  # 0.795 nats
    per_window = {  # 1 - copy / against, one window alone: the bootstrap's extremes with two windows
        "recall": (1 - 0.595 / 1.6, 1 - 0.995 / 1.6),
        "recall_null": (1 - 0.595 / 1.2, 1 - 0.995 / 1.6),
        "recall_scrambled": (1 - 0.595 / 1.8, 1 - 0.995 / 1.6),
    }
    for row in rows:
        assert int(row["n_bases"]) == 2 * (LEN - SKIP) and int(row["n_windows"]) == 2
        assert float(row["copy_bits"]) == pytest.approx(copy / LN2, rel=1e-5)
        assert float(row["first_bits"]) == pytest.approx(1.6 / LN2, rel=1e-5)
        assert float(row["null_bits"]) == pytest.approx(1.4 / LN2, rel=1e-5)
        assert float(row["scrambled_bits"]) == pytest.approx(1.7 / LN2, rel=1e-5)
        assert float(row["scrambled_bits_lo"]) == pytest.approx(1.6 / LN2, rel=1e-5)
        assert float(row["scrambled_bits_hi"]) == pytest.approx(1.8 / LN2, rel=1e-5)
        assert float(row["recall"]) == pytest.approx(1 - 0.795 / 1.6, rel=1e-5)
        assert float(row["recall_null"]) == pytest.approx(1 - 0.795 / 1.4, rel=1e-5)
        assert float(row["recall_scrambled"]) == pytest.approx(1 - 0.795 / 1.7, rel=1e-5)
        for name, ends in per_window.items():
            assert float(row[f"{name}_lo"]) == pytest.approx(min(ends), rel=1e-5)
            assert float(row[f"{name}_hi"]) == pytest.approx(max(ends), rel=1e-5)

    offsets = list(csv.DictReader(io.StringIO(offsets_csv(res))))
    assert list(offsets[0])[-3:] == ["first_bits", "null_bits", "scrambled_bits"]
    at3 = next(r for r in offsets if r["distance"] == "40" and r["offset"] == "3")
    assert float(at3["copy_bits"]) == pytest.approx((0.4 + 0.8 + 0.06) / 2 / LN2, rel=1e-5)
    assert float(at3["scrambled_bits"]) == pytest.approx(1.7 / LN2, rel=1e-5)

    doc = json.loads(to_json(res))
    model = doc["models"]["m"]
    assert [e["value"] for e in model["recall_scrambled"]] == pytest.approx([1 - 0.795 / 1.7] * 3, rel=1e-5)
    assert [e["value"] for e in model["recall_null"]] == pytest.approx([1 - 0.795 / 1.4] * 3, rel=1e-5)
    assert model["scrambled_bits"][0]["value"] == pytest.approx(1.7 / LN2, rel=1e-5)
    assert doc["summary"]["m"]["longest"]["recall_scrambled"]["value"] == pytest.approx(1 - 0.795 / 1.7, rel=1e-5)
    headline = summary_text(res).splitlines()[-1]
    assert headline == (
        "recall at the longest distance (400): stub +0.503 [+0.378, +0.628], vs scrambled +0.532 [+0.378, +0.669], "
        "vs null +0.432 [+0.378, +0.504]"
    )


def test_a_partial_file_of_three_kinds_is_refused_then_rerun(tmp_path):
    # A partial file as the older eval-recall wrote it: the same fingerprint without the scoring
    # and kinds entries, three kinds per row, one window still to score.
    windows = make_windows(3, SEQ, seed=4, n_run=False)
    layout = RecallLayout(seq=SEQ, length=LEN, distances=DISTANCES, skip=SKIP)
    settings = RecallSettings(layout, tmp_path / "e", n_boot=100, progress=False)
    model = GRULM(0)
    run = lambda s: evaluate(s, {"m": spec("m")}, lambda: iter(windows), lambda role: scorer(model), echo=lambda _: None)  # noqa: E731
    fresh = run(settings)
    path = tmp_path / "e" / PARTIAL_NAME
    header, *rows = (json.loads(x) for x in path.read_text().splitlines())
    del header["fingerprint"]["scoring"], header["fingerprint"]["kinds"]
    old_rows = [{**r, "sums": [kinds[:3] for kinds in r["sums"]]} for r in rows[:2]]
    path.write_text("".join(json.dumps(x) + "\n" for x in (header, *old_rows)))

    with pytest.raises(GenolongError, match=r"different evaluation \(kinds: None before, \['copy', 'first', 'null', 'scrambled'\] now\)"):
        run(settings)
    assert len(path.read_text().splitlines()) == 3  # left as it was

    calls = model.calls
    again = run(RecallSettings(layout, tmp_path / "e", n_boot=100, progress=False, overwrite=True))
    assert model.calls - calls == 3 * 3  # every window, three passes: nothing of the old file was kept
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert "kinds" in lines[0]["fingerprint"] and all(np.shape(r["sums"]) == (3, 4, LEN) for r in lines[1:])
    for key in fresh.loss:
        np.testing.assert_array_equal(again.loss[key].value, fresh.loss[key].value)
