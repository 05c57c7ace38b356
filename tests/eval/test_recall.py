"""eval-recall: the layout's refusals, per-copy bookkeeping against a direct computation with
stand-in models whose use of context is known, resume, and the command end to end (the scrambled
control's construction and hand-computed scores: test_recall_controls.py)."""

import csv
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from genolong.data import open_prepared, prepare, tile_windows
from genolong.data.planted import scramble_sources, window_rng
from genolong.errors import GenolongError
from genolong.eval.recall import RecallSettings, evaluate, plant_for_eval
from genolong.eval.recall_layout import RecallLayout
from genolong.eval.store import PARTIAL_NAME
from genolong.model import GenoLongForCausalLM, get_preset, save_pretrained
from genolong.model.checkpoint import from_pretrained
from genolong.train import checkpoint as ckpt_io
from tests.eval.standins import make_windows, scorer, spec
from tests.eval.test_cli import genolong

SEQ, LEN, SKIP = 512, 32, 8
DISTANCES = (40, 150, 400)
K = 6  # the induction stand-in's match length
LN2 = math.log(2)


class InductionLM(torch.nn.Module):
    """Predicts the base that followed the last earlier occurrence of the current 6-mer (p = 0.97),
    else uniform over ACGT: it uses context at any distance, like a perfect induction head."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(8, 8, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(8))
        self.calls = 0

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = torch.full((*ids.shape, 8), -30.0)
        for b, row in enumerate(ids.tolist()):
            last: dict[tuple, int] = {}
            for t in range(len(row)):
                out[b, t, :4] = math.log(0.25)
                key = tuple(row[max(0, t - K + 1) : t + 1])
                if t >= K - 1 and key in last and last[key] + 1 < len(row):
                    nxt = row[last[key] + 1]
                    out[b, t, :4] = math.log(0.01)
                    out[b, t, nxt] = math.log(0.97)
                if t >= K - 1:
                    last[key] = t
        return out


class BigramLM(torch.nn.Module):
    """A fixed table p(next | current base): no context beyond one base, so recall is exactly 0."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(8, 8, generator=gen)
        self.lm_head = torch.nn.Linear(8, 8, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(8))
        self.calls = 0

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.table[ids]


def _run(out, windows, models, **kw):
    layout = RecallLayout(seq=SEQ, length=LEN, distances=DISTANCES, skip=SKIP)
    settings = RecallSettings(layout, out, windows=kw.pop("limit", 50), n_boot=200, progress=False, **kw)
    specs = {role: spec(role) for role in models}
    lines = []
    res = evaluate(settings, specs, lambda: iter(windows), lambda role: scorer(models[role]), echo=lines.append)
    return res, "\n".join(lines)


def _direct(model, tokens):
    """Per-target loss by the plainest route: all logits, renormalised over A, C, G, T (ids 0-3)."""
    with torch.no_grad():
        logits = model.hidden_states(torch.from_numpy(tokens.astype(np.int64))[None, :-1])[0].double()
    targets = torch.from_numpy(tokens[1:].astype(np.int64))
    return F.cross_entropy(logits[:, :4], targets.masked_fill(targets > 3, -100), reduction="none").numpy()  # N: not scored


def test_layout_refusals():
    RecallLayout(seq=SEQ, length=LEN, distances=DISTANCES, skip=SKIP)
    for kwargs, needle in (
        ({"distances": (20, 100)}, "shorter than --len 32"),
        ({"distances": (100, 490)}, "needs windows of more than 522 bases, and --seq is 512: use distances up to 479"),
        ({"distances": (100, 100)}, "increasing and without repeats"),
        ({"distances": ()}, "--distances is empty"),
        ({"skip": 32}, "--skip 32 must be in [0, --len 32)"),
        ({"distances": (40, 50, 60, 70, 80)}, "would fill over half"),
    ):
        with pytest.raises(GenolongError) as err:
            RecallLayout(**{"seq": SEQ, "length": LEN, "distances": DISTANCES, "skip": SKIP, **kwargs})
        assert needle in str(err.value)
    assert RecallLayout.auto_distances(65536, 64) == (1024, 4096, 16384, 49152)
    assert RecallLayout.auto_distances(2048, 64) == (128, 512, 1536)


def test_numbers_match_a_direct_computation(tmp_path):
    windows = make_windows(6, SEQ, seed=3)
    models = {"induction": InductionLM(), "bigram": BigramLM()}
    res, text = _run(tmp_path / "e", windows, models)
    layout = res.layout
    planted = [plant_for_eval(w, layout, 0) for w in windows]
    kept = [p for p in planted if p is not None]
    assert [(p.record, p.start, p.reverse) for p in kept] == res.windows and len(kept) >= 5
    with open(tmp_path / "e" / "recall.csv") as f:
        rows = {(r["model"], int(r["distance"])): r for r in csv.DictReader(f)}
    for role, model in models.items():
        sums = np.zeros((len(DISTANCES), 4))
        n = np.zeros(len(DISTANCES))
        for p in kept:
            with_copies, original = _direct(model, p.tokens), _direct(model, p.original)
            scrambled = _direct(model, scramble_sources(p, 0)[0])
            for c in p.copies:
                i = DISTANCES.index(c.distance)
                # Target j's loss is entry j - 1; the headline takes copy offsets SKIP..LEN-1.
                for o in range(SKIP, LEN):
                    assert p.tokens[c.dest + o] == p.tokens[c.source + o] == p.original[c.source + o]
                    sums[i] += (with_copies[c.dest + o - 1], with_copies[c.source + o - 1], original[c.dest + o - 1], scrambled[c.dest + o - 1])
                    n[i] += 1
        bits = sums / n[:, None] / LN2
        for i, d in enumerate(DISTANCES):
            row = rows[(role, d)]
            assert int(row["n_bases"]) == n[i] == len(kept) * (LEN - SKIP)
            got = [float(row[k]) for k in ("copy_bits", "first_bits", "null_bits", "scrambled_bits")]
            np.testing.assert_allclose(got, bits[i], rtol=1e-5)
            assert float(row["recall"]) == pytest.approx(1 - bits[i, 0] / bits[i, 1], rel=1e-5)
            assert float(row["recall_null"]) == pytest.approx(1 - bits[i, 0] / bits[i, 2], rel=1e-5)
            assert float(row["recall_scrambled"]) == pytest.approx(1 - bits[i, 0] / bits[i, 3], rel=1e-5)
            for q in ("recall", "recall_null", "recall_scrambled", "scrambled_bits"):
                assert float(row[f"{q}_lo"]) <= float(row[q]) <= float(row[f"{q}_hi"])
            assert float(row["copy_bits_lo"]) <= float(row["copy_bits"]) <= float(row["copy_bits_hi"])
    # The stand-ins behave as designed: the induction model recalls at every distance, the
    # bigram model cannot (its copy and first-occurrence losses are the same numbers).
    assert all(float(rows[("induction", d)]["recall"]) > 0.8 for d in DISTANCES)
    assert all(abs(float(rows[("bigram", d)]["recall"])) < 1e-9 for d in DISTANCES)
    # The scrambled control: the induction model loses its copy with the source (back to ~2 bits);
    # the bigram model sees the same base before each copy base either way, so it scores the
    # scrambled copy exactly as the copy: position-matched, its copying gain is exactly 0.
    assert all(float(rows[("induction", d)]["recall_scrambled"]) > 0.8 for d in DISTANCES)
    assert all(float(rows[("induction", d)]["scrambled_bits"]) > 1.9 for d in DISTANCES)
    assert all(abs(float(rows[("bigram", d)]["recall_scrambled"])) < 1e-9 for d in DISTANCES)
    doc = json.loads((tmp_path / "e" / "recall.json").read_text())
    assert doc["low_window_warning"] is True and "fewer than 20 windows" in text
    offsets = np.array(doc["models"]["induction"]["offset_bits"]["copy"][-1])
    # Along the copy: unpredictable until a whole 6-mer of the copy is in view, then near-perfect
    # (but for the odd chance 6-mer match between source and copy that misleads the stand-in).
    assert offsets[:K].min() > 1.9 and np.median(offsets[K:]) < 0.1
    assert (tmp_path / "e" / "recall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "recall at the longest distance (400)" in (tmp_path / "e" / "summary.txt").read_text()


def test_placement_is_the_same_for_every_model_and_seeded():
    w = make_windows(1, SEQ, seed=5, n_run=False)[0]
    layout = RecallLayout(seq=SEQ, length=LEN, distances=DISTANCES, skip=SKIP)
    a, b, c = plant_for_eval(w, layout, 0), plant_for_eval(w, layout, 0), plant_for_eval(w, layout, 1)
    assert a.copies == b.copies and a.copies != c.copies
    assert sorted(x.distance for x in a.copies) == list(DISTANCES)
    assert window_rng(0, w).integers(1 << 30) == window_rng(0, w).integers(1 << 30)


def test_resume_scores_only_the_missing_windows(tmp_path):
    windows = make_windows(5, SEQ, seed=4, n_run=False)
    reference, _ = _run(tmp_path / "ref", windows, {"m": BigramLM()})

    class Boom(Exception):
        pass

    model = BigramLM()
    calls = {"n": 0}

    def flaky(role):
        s = scorer(model)
        losses = s.losses

        def counted(ids):
            calls["n"] += 1
            if calls["n"] == 10:  # in window 4 (3 passes per window)
                raise Boom
            return losses(ids)

        s.losses = counted
        return s

    layout = RecallLayout(seq=SEQ, length=LEN, distances=DISTANCES, skip=SKIP)
    settings = RecallSettings(layout, tmp_path / "e", n_boot=200, progress=False)
    with pytest.raises(Boom):
        evaluate(settings, {"m": spec("m")}, lambda: iter(windows), flaky, echo=lambda _: None)
    assert len((tmp_path / "e" / PARTIAL_NAME).read_text().splitlines()) == 1 + 3
    calls["n"] = -100
    res = evaluate(settings, {"m": spec("m")}, lambda: iter(windows), flaky, echo=lambda _: None)
    assert calls["n"] == -100 + 2 * 3  # windows 4 and 5 only
    np.testing.assert_array_equal(res.loss[("m", "copy")].value, reference.loss[("m", "copy")].value)
    other = RecallSettings(RecallLayout(seq=SEQ, length=LEN, distances=(40, 150), skip=SKIP), tmp_path / "e", progress=False)
    with pytest.raises(GenolongError, match="different evaluation"):
        evaluate(other, {"m": spec("m")}, lambda: iter(windows), flaky, echo=lambda _: None)


def test_resume_follows_the_models_content_not_its_path(tmp_path):
    # A run directory moved or copied between the interruption and the resume still resumes (the
    # fingerprint is the same); other weights under the same path are refused.
    import dataclasses

    windows = make_windows(3, SEQ, seed=4, n_run=False)
    layout = RecallLayout(seq=SEQ, length=LEN, distances=DISTANCES, skip=SKIP)
    settings = RecallSettings(layout, tmp_path / "e", n_boot=200, progress=False)
    first = dataclasses.replace(spec("m"), identity={"model_dir": "/runs/a/model", "fingerprint": "f1"})
    evaluate(settings, {"m": first}, lambda: iter(windows[:2]), lambda role: scorer(BigramLM()), echo=lambda _: None)
    moved = dataclasses.replace(first, identity={"model_dir": "/elsewhere/moved/model", "fingerprint": "f1"})
    calls = {"n": 0}

    def counting(role):
        s = scorer(BigramLM())
        losses = s.losses
        s.losses = lambda ids: (calls.__setitem__("n", calls["n"] + 1), losses(ids))[1]
        return s

    evaluate(settings, {"m": moved}, lambda: iter(windows), counting, echo=lambda _: None)
    assert calls["n"] == 3  # only the third window, three passes
    changed = dataclasses.replace(first, identity={"model_dir": "/runs/a/model", "fingerprint": "f2"})
    with pytest.raises(GenolongError, match="different evaluation"):
        evaluate(settings, {"m": changed}, lambda: iter(windows), counting, echo=lambda _: None)


def _fasta(path, rng):
    seq = "".join(rng.choice(list("ACGTacgt"), 3000))
    seq = seq[:1200] + "N" * 100 + seq[1300:]
    train = "".join(rng.choice(list("ACGT"), 2000))
    path.write_text(f">chr1\n{train}\n>chr22\n{seq}\n")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("recallcli")
    _fasta(root / "g.fa", np.random.default_rng(0))
    prepare(root / "g.fa", root / "data", train="chr1", holdout="chr22", progress=False, log=lambda _: None)
    run = root / "run"
    run.mkdir()
    (run / ckpt_io.OPTIONS_FILE).write_text(json.dumps({"preset": "tiny"}))
    torch.manual_seed(0)
    model = GenoLongForCausalLM(get_preset("tiny"))
    ckpt_io.save(run, 5, lambda p: save_pretrained(model, p), {}, {"step": 5, "dna_token_ids": None}, keep_last=5)
    torch.manual_seed(1)
    base = save_pretrained(GenoLongForCausalLM(get_preset("tiny")), root / "base")
    return {"data": root / "data", "run": run, "base": base}


ARGS = ("--seq", "512", "--len", "32", "--skip", "8", "--distances", "40,150,400", "--bootstrap", "100", "--no-progress")


def test_command_end_to_end(world, monkeypatch, capsys, tmp_path):
    out = tmp_path / "e"
    code, stdout, err = genolong(
        monkeypatch, capsys, "eval-recall", "--data", world["data"], "--checkpoint", world["run"], "--baseline", world["base"], "--out", out, *ARGS,
        "--loss-chunk", "2k",  # lengths as every other command spells them
    )
    assert code == 0, err
    doc = json.loads((out / "recall.json").read_text())
    # chr22 tiles at 0, 512, 1024 (100 N: too many under the default 0.1), 1536, 2048 (2560 is cut off).
    assert [(w["record"], w["start"]) for w in doc["windows"]] == [("chr22", s) for s in (0, 512, 1536, 2048)]
    assert list(doc["models"]) == ["baseline", "checkpoint"]
    assert doc["models"]["checkpoint"]["label"] == "run step 5"
    assert doc["meta"]["kernels"]["kda"] == {"reference": 3}
    # One planted window by hand: the tiny model's own losses at the copy, first occurrence and null.
    model = from_pretrained(world["run"] / "checkpoints/step_00000005/model", dtype=torch.float32)
    layout = RecallLayout(seq=512, length=32, distances=(40, 150, 400), skip=8)
    w = next(iter(tile_windows(open_prepared(world["data"]), "holdout", 512)))
    p = plant_for_eval(w, layout, 0)
    with torch.no_grad():
        def direct(tokens):
            ids = torch.from_numpy(tokens.astype(np.int64))[None]
            return F.cross_entropy(model(ids[:, :-1]).logits[0, :, :4].double(), ids[0, 1:], reduction="none").numpy()

        planted, original = direct(p.tokens), direct(p.original)
    line = next(json.loads(x) for x in (out / PARTIAL_NAME).read_text().splitlines()[1:] if json.loads(x)["model"] == "checkpoint")
    c = next(c for c in p.copies if c.distance == 400)
    o = np.arange(32)
    got = np.array(line["sums"][2])  # distance 400
    np.testing.assert_allclose(got[0], planted[c.dest + o - 1], rtol=1e-5)
    np.testing.assert_allclose(got[1], planted[c.source + o - 1], rtol=1e-5)
    np.testing.assert_allclose(got[2], original[c.dest + o - 1], rtol=1e-5)
    with torch.no_grad():
        scrambled = direct(scramble_sources(p, 0)[0])
    np.testing.assert_allclose(got[3], scrambled[c.dest + o - 1], rtol=1e-5)
    for name in ("recall.csv", "recall_offsets.csv", "recall.png", "summary.txt"):
        assert (out / name).stat().st_size > 0
    assert "recall at the longest distance (400)" in stdout


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--distances", "40,500"), "--distances 500 with --len 32 needs windows of more than 532 bases, and --seq is 512"),
        (("--distances", "16,100"), "shorter than --len 32"),
        (("--split", "validation"), "split 'validation' is not in"),
        (("--seq", "4k", "--distances", "1k"), "no record in split 'holdout'"),
        (("--loss-chunk", "0"), "--loss-chunk must be positive, got '0'"),
    ],
)
def test_bad_input_is_one_clear_line(world, monkeypatch, capsys, tmp_path, extra, needle):
    args = dict(zip(ARGS[:-1:2], ARGS[1:-1:2]))
    args.update(dict(zip(extra[::2], extra[1::2])))
    flat = [x for kv in args.items() for x in kv]
    code, _, err = genolong(monkeypatch, capsys, "eval-recall", "--data", world["data"], "--checkpoint", world["run"], "--out", tmp_path / "e", *flat, "--no-progress")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("genolong: error:"), err
    assert needle in lines[0]
    assert not (tmp_path / "e" / "recall.json").exists()
