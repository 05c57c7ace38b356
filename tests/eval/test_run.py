"""The eval job with stand-in models: outputs, yardsticks, warnings, resume after an interruption, refusals."""

import csv
import io
import json

import numpy as np
import pytest

from genolong.errors import GenolongError
from genolong.eval import markov as markov_mod
from genolong.eval.positional import Layout
from genolong.eval.run import Settings, evaluate
from genolong.eval.store import PARTIAL_NAME
from genolong.vocab import N_ID
from tests.eval.standins import GRULM, make_windows, scorer, spec

SEQ = 256


def run(out, windows, models=None, specs=None, layout=None, markov=None, **kw):
    models = models or {"baseline": GRULM(0), "checkpoint": GRULM(1)}
    specs = specs or {"baseline": spec(), "checkpoint": spec()}
    settings = Settings(layout or Layout(SEQ, 64, 64), out, n_boot=200, progress=False, **kw)
    lines = []
    res = evaluate(settings, specs, lambda: iter(windows), lambda role: scorer(models[role]), echo=lines.append, markov=markov)
    return res, models, "\n".join(lines)


def small_markov():
    rng = np.random.default_rng(9)
    train = [rng.integers(0, 4, 5000).astype(np.uint8)]
    return markov_mod.fit(train, [rng.integers(0, 4, 1000).astype(np.uint8)], max_order=3)


def test_outputs_and_summary(tmp_path):
    windows = make_windows(5, SEQ)
    res, _, text = run(tmp_path / "e", windows, markov=small_markov())
    out = tmp_path / "e"
    for name in ("positional.csv", "positional.json", "positional.png", "summary.txt"):
        assert (out / name).stat().st_size > 0
    assert (out / "positional.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "positional.json").read_text())
    assert doc["bucket_edges"] == [0, 64, 128, 192, 256]
    assert len(doc["windows"]) == 5
    assert doc["summary"]["n_tokens"] == sum(int((w.tokens[1:] != 4).sum()) for w in windows)
    rows = list(csv.DictReader(io.StringIO((out / "positional.csv").read_text())))
    # (uniform + markov: full only; baseline + checkpoint: full + truncated) x 3 base classes x 4 buckets
    assert len(rows) == (2 * 1 + 2 * 2) * 3 * 4
    assert "loss_nats" not in rows[0] and "bits_per_base" in rows[0]
    assert "late - early" in text and "long-range part" in text and "bits/base" in text
    assert (out / "summary.txt").read_text().strip() == text.strip()
    # relative change = (checkpoint - baseline) / baseline, bucket by bucket
    base = res.loss[("baseline", "full", "all")].value
    ck = res.loss[("checkpoint", "full", "all")].value
    assert np.allclose(res.rel[("full", "all")].value, ck / base - 1)


def test_yardsticks_are_scored_on_the_same_targets(tmp_path):
    windows = make_windows(4, SEQ)
    model = small_markov()
    res, _, text = run(tmp_path / "e", windows, markov=model)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "e" / "positional.csv").read_text())))
    uniform = [r for r in rows if r["model"] == "uniform"]
    assert {r["bits_per_base"] for r in uniform} == {"2"} and {r["context"] for r in uniform} == {"full"}
    # Markov bucket means, directly: its per-target losses (nats) over the windows' non-N targets.
    sums, counts = np.zeros(4), np.zeros(4)
    for w in windows:
        loss = model.losses(w.tokens) / np.log(2)
        for j in range(1, SEQ):
            if w.tokens[j] != N_ID:
                sums[j // 64] += loss[j - 1]
                counts[j // 64] += 1
    got = [float(r["bits_per_base"]) for r in rows if (r["model"], r["bases"]) == ("markov", "all")]
    np.testing.assert_allclose(got, sums / counts, rtol=1e-5)
    s = json.loads((tmp_path / "e" / "positional.json").read_text())["summary"]
    assert s["bits_per_base"]["uniform"]["value"] == 2.0
    assert s["bits_per_base"]["markov"]["value"] == pytest.approx(sums.sum() / counts.sum())
    ck = s["bits_per_base"]["checkpoint"]["value"]
    assert s["minus_markov_bits"]["checkpoint"]["value"] == pytest.approx(ck - sums.sum() / counts.sum())
    assert f"Markov order {model.order}" in text


def test_few_windows_are_flagged_in_summary_json_and_plot_title(tmp_path):
    from genolong.eval import plot

    titles = []
    real = plot._title
    res, _, text = run(tmp_path / "few", make_windows(3, SEQ))
    assert "WARNING: only 3 windows" in text
    doc = json.loads((tmp_path / "few" / "positional.json").read_text())
    assert doc["summary"]["interval_warning"].startswith("only 3 windows")
    titles.append(real(res, {"baseline": "b", "checkpoint": "c", "markov": "m", "uniform": "u"}, res.interval_warning()))
    assert "WARNING (hatched bands): only 3 windows" in titles[0]
    many, _, text = run(tmp_path / "many", make_windows(20, SEQ), layout=Layout(SEQ, 64, None))
    assert many.interval_warning() is None and "WARNING" not in text


def test_both_controls_end_to_end(tmp_path):
    windows = make_windows(4, SEQ, n_run=False)
    layout = Layout(SEQ, 64, 64, controls=("truncated", "shuffled"))
    res, models, text = run(tmp_path / "e", windows, layout=layout)
    # per window: 1 full pass + 2 truncated blocks + 2 shuffled blocks
    assert models["baseline"].calls == 4 * 5
    rows = list(csv.DictReader(io.StringIO((tmp_path / "e" / "positional.csv").read_text())))
    assert {r["context"] for r in rows if r["model"] == "checkpoint"} == {"full", "truncated", "shuffled"}
    s = res.summary()
    for ctx in ("truncated", "shuffled"):
        assert f"long_range_late_{ctx}" in s and f"{ctx} minus full context" in text
        full_late = res.rel[("full", "all")].value[-1]
        assert s[f"long_range_late_{ctx}"]["value"] == pytest.approx(full_late - res.rel[(ctx, "all")].value[-1])
    # early buckets (targets < 2C) have no context beyond the real C-2C: every control equals full there
    for ctx in ("truncated", "shuffled"):
        np.testing.assert_allclose(res.loss[("checkpoint", ctx, "all")].value[:2], res.loss[("checkpoint", "full", "all")].value[:2])


def test_resume_after_interruption_scores_only_missing_windows(tmp_path):
    windows = make_windows(6, SEQ)
    reference, _, _ = run(tmp_path / "ref", windows)

    class Boom(Exception):
        pass

    def interrupted():
        for i, w in enumerate(windows):
            if i == 4:
                raise Boom
            yield w

    # Calls of windows(): 1 lists the keys, 2 is the baseline pass (completes), 3 is the
    # checkpoint pass, which dies after 4 windows.
    calls = {"n": 0}

    def windows_fn():
        calls["n"] += 1
        return iter(windows) if calls["n"] <= 2 else interrupted()

    models = {"baseline": GRULM(0), "checkpoint": GRULM(1)}
    settings = Settings(Layout(SEQ, 64, 64), tmp_path / "e", n_boot=200, progress=False)
    with pytest.raises(Boom):
        evaluate(settings, {"baseline": spec(), "checkpoint": spec()}, windows_fn, lambda r: scorer(models[r]), echo=print)
    assert not (tmp_path / "e" / "positional.csv").exists()  # nothing final before the end
    lines = (tmp_path / "e" / PARTIAL_NAME).read_text().splitlines()
    assert len(lines) == 1 + 6 + 4
    # A torn last line, as from a kill during the write, is dropped.
    with open(tmp_path / "e" / PARTIAL_NAME, "a") as f:
        f.write('{"kind": "window", "model": "checkp')

    res, fresh, _ = run(tmp_path / "e", windows)
    assert fresh["baseline"].calls == 0
    # 2 windows left for the checkpoint, each: 1 full pass + 2 truncated-control blocks (128-192, 192-256)
    assert fresh["checkpoint"].calls == 2 * 3
    assert (tmp_path / "e" / "positional.csv").read_text() == (tmp_path / "ref" / "positional.csv").read_text()

    # And a third run with everything done scores nothing and gives the same tables.
    _, again, _ = run(tmp_path / "e", windows)
    assert again["baseline"].calls == again["checkpoint"].calls == 0


def test_more_windows_extend_a_finished_run(tmp_path):
    windows = make_windows(6, SEQ)
    run(tmp_path / "e", windows[:3])
    _, models, _ = run(tmp_path / "e", windows)
    assert models["baseline"].calls == 3 * 3


def test_partial_from_other_settings_is_refused(tmp_path):
    windows = make_windows(2, SEQ)
    run(tmp_path / "e", windows)
    with pytest.raises(GenolongError, match="different evaluation.*bucket") as err:
        run(tmp_path / "e", windows, layout=Layout(SEQ, 32, 64))
    assert "--overwrite" in str(err.value)
    run(tmp_path / "e", windows, layout=Layout(SEQ, 32, 64), overwrite=True)


@pytest.mark.parametrize(
    ("other", "word"),
    [({"kind": "gru", "layers": 2}, "architectures"), ({"kind": "gru", "vocab_size": 154880}, "vocabularies")],
)
def test_models_of_different_architectures_or_vocabularies_are_refused(tmp_path, other, word):
    specs = {"baseline": spec("a"), "checkpoint": spec("b", **{k: v for k, v in other.items() if k != "kind"})}
    with pytest.raises(GenolongError, match=word) as err:
        run(tmp_path / "e", make_windows(2, SEQ), specs=specs)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "e").exists()


def test_different_token_maps_are_refused(tmp_path):
    specs = {"baseline": spec("a"), "checkpoint": spec("b")}
    specs["checkpoint"].token_map = [65, 67, 71, 84, 78]
    with pytest.raises(GenolongError, match="vocabularies"):
        run(tmp_path / "e", make_windows(2, SEQ), specs=specs)


def test_no_usable_window_is_refused(tmp_path):
    with pytest.raises(GenolongError, match="no usable window"):
        run(tmp_path / "e", [])


def test_without_control(tmp_path):
    res, _, text = run(tmp_path / "e", make_windows(3, SEQ), layout=Layout(SEQ, 64, None))
    rows = (tmp_path / "e" / "positional.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 * 1 * 3 * 4 and all(",full," in r for r in rows[1:])  # uniform, baseline, checkpoint
    assert "long-range" not in text
    doc = json.loads((tmp_path / "e" / "positional.json").read_text())
    assert doc["control_context"] is None and doc["controls"] == []
    assert not any(k.startswith("long_range_late") for k in doc["summary"])


def test_other_controls_are_a_different_evaluation(tmp_path):
    windows = make_windows(2, SEQ)
    run(tmp_path / "e", windows)
    with pytest.raises(GenolongError, match="different evaluation.*controls"):
        run(tmp_path / "e", windows, layout=Layout(SEQ, 64, 64, controls=("truncated", "shuffled")))


def test_numbers_print_without_negative_zero():
    from genolong.eval.report import bits, pct

    assert pct({"value": -1e-9, "lo": -2e-7, "hi": 0.0123}) == "+0.00% [+0.00, +1.23]"
    assert bits({"value": -4e-6, "lo": -0.00012, "hi": 3e-6}, signed=True) == "+0.0000 [-0.0001, +0.0000]"
    assert bits({"value": 2.0, "lo": 2.0, "hi": 2.0}) == "2.0000"


def test_one_bucket_reports_no_late_minus_early(tmp_path):
    # --bucket = --seq: the first and last buckets with targets are one bucket; their difference of
    # exactly 0 would read as a result.
    _, _, text = run(tmp_path / "e", make_windows(3, SEQ), layout=Layout(SEQ, SEQ, 64))
    doc = json.loads((tmp_path / "e" / "positional.json").read_text())
    assert doc["summary"]["late_minus_early"] == {"value": None, "lo": None, "hi": None}
    assert "late - early n/a" in text
    assert doc["summary"]["long_range_late_truncated"]["value"] is not None  # the controls still say something


def test_buckets_that_are_not_whole_k_are_labelled_in_plain_numbers(tmp_path):
    from genolong.eval.plot import _tokens

    _, _, text = run(tmp_path / "e", make_windows(3, SEQ), layout=Layout(SEQ, 100, 64))
    assert "late (200-256)" in text and "early (0-100)" in text
    assert [_tokens(x) for x in (0, 1000, 2000, 2048, 4096, 1 << 20, 1500000)] == [
        "0", "1,000", "2,000", "2k", "4k", "1M", "1,500,000"]


def test_the_summary_reports_the_reach_of_the_scored_windows(tmp_path):
    """A 20-mer copied from the window's start into its late bucket, beyond C: the summary and the JSON
    carry its share of the late bucket (what genolong reach counts for the same windows)."""
    windows = make_windows(2, SEQ, n_run=False)
    for w in windows:
        w.tokens[200:240] = w.tokens[10:50]  # 190 back, beyond C = 64; targets 220..240 in the late bucket
        w.repeat_mask[:] = False
    res, _, text = run(tmp_path / "r", windows, layout=Layout(SEQ, 64, 64, controls=("truncated",)))
    reach = json.loads((tmp_path / "r" / "positional.json").read_text())["meta"]["reach"]
    late_scored = sum(int((w.tokens[1:][191:] != 4).sum()) for w in windows)  # targets 192..255
    assert reach["k"] == 20 and reach["beyond"] == 64
    assert reach["late_share"] == pytest.approx(2 * (240 - 220 + 1) / late_scored, abs=2 / late_scored)
    assert "reach (genolong reach, k=20)" in text and "ceiling for the long-range part" in text
