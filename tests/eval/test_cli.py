"""`genolong eval-positional` end to end on CPU: prepared data, tiny GLM-architecture checkpoints.

The numbers in positional.json are checked against a direct computation in this test: the
model run on each window with full logits, the four base columns log-softmaxed, N masked,
bucket means accumulated by hand. Bad inputs get one line on stderr and exit code 2.
"""

import json
import math
import shutil
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from genolong import cli
from genolong.data import open_prepared, prepare
from genolong.model import GenoLongForCausalLM, get_preset, save_pretrained
from genolong.model.checkpoint import from_pretrained
from genolong.train import checkpoint as ckpt_io
from genolong.vocab import N_ID

SEQ, BUCKET, CONTROL = 512, 128, 128


def _fasta(path, rng):
    def record(name, n, n_run=None):
        s = np.array(list(rng.choice(list("ACGTacgt"), n)))
        if n_run:
            s[n_run[0] : n_run[1]] = "N"
        seq = "".join(s)
        return f">{name}\n" + "\n".join(seq[i : i + 70] for i in range(0, n, 70)) + "\n"

    path.write_text(record("chr1", 6000) + record("chr22", 3500, (1500, 1700)) + record("chrY", 900))


def _model(path, seed, **overrides):
    torch.manual_seed(seed)
    save_pretrained(GenoLongForCausalLM(get_preset("tiny", **overrides)), path)
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalcli")
    _fasta(root / "g.fa", np.random.default_rng(0))
    prepare(root / "g.fa", root / "data", train="chr1", holdout="chr22,chrY", progress=False, log=lambda _: None)
    base = _model(root / "base", 0)
    # A "run" whose checkpoints are step 0 (the base weights) and step 3 (other weights).
    run = root / "run"
    run.mkdir()
    (run / ckpt_io.OPTIONS_FILE).write_text(json.dumps({"preset": "tiny"}))
    for step, seed in ((0, 0), (3, 1)):
        torch.manual_seed(seed)
        model = GenoLongForCausalLM(get_preset("tiny"))
        ckpt_io.save(run, step, lambda p, m=model: save_pretrained(m, p), {}, {"step": step, "dna_token_ids": None}, keep_last=5)
    return {"root": root, "data": root / "data", "base": base, "run": run}


def genolong(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["genolong", *map(str, args)])
    code = 0
    try:
        cli.main()
    except SystemExit as exit_:
        code = exit_.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def direct_full(model, tokens, token_map=(0, 1, 2, 3, 4)):
    """Per-target bits by the plainest route: full logits, the four base columns (token_map[:4])
    log-softmaxed in float64 (N targets: any value, they are masked)."""
    ids = torch.from_numpy(np.asarray(token_map)[tokens.astype(np.int64)])[None]
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits[0].double()[:, list(token_map[:4])]
    targets = torch.from_numpy(np.minimum(tokens[1:], 3).astype(np.int64))
    return -F.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0].numpy() / math.log(2)


def direct_control(model, tokens, targets):
    """Bits of each target j given only tokens[s - C : j], s = start of j's control block. One forward
    of tokens[s - C :] per block serves all its targets: the model is causal, so the logits at j
    see exactly tokens[s - C : j] (direct_full relies on the same for the full context)."""
    bits = {}
    for s in sorted({(j // CONTROL) * CONTROL for j in targets}):
        mine = [j for j in targets if (j // CONTROL) * CONTROL == s]
        full = direct_full(model, tokens[s - CONTROL : max(mine) + 1])
        bits.update({j: full[j - (s - CONTROL) - 1] for j in mine})
    return bits


ARGS = ("--seq", "512", "--bucket", "128", "--control-context", "128", "--bootstrap", "200",
        "--max-n-fraction", "0.5", "--max-windows", "4", "--markov-max-order", "4", "--no-progress")


def test_end_to_end_numbers_match_a_direct_computation(world, monkeypatch, capsys, tmp_path):
    out = tmp_path / "e"
    code, stdout, err = genolong(
        monkeypatch, capsys, "eval-positional", "--data", world["data"], "--checkpoint", world["run"], "--out", out, *ARGS
    )
    assert code == 0, err
    assert "late - early" in stdout and "long-range part" in stdout and "Markov order" in stdout
    assert "the last 10% of each train record (the data has no validation split)" in stdout
    assert "fitting the Markov baseline" in err
    doc = json.loads((out / "positional.json").read_text())
    assert doc["controls"] == ["truncated", "shuffled"]  # the default
    assert doc["summary"]["interval_warning"].startswith("only 4 windows")
    assert doc["meta"]["models"]["baseline"]["label"] == "run step 0"  # the default baseline: RUN@0
    assert doc["meta"]["models"]["checkpoint"]["label"] == "run step 3"
    # chr22 tiles at 0, 512, 1024 (36 N), 1536 (164 N): --max-windows 4 stops there; chrY is too short
    assert [(w["record"], w["start"]) for w in doc["windows"]] == [("chr22", s) for s in (0, 512, 1024, 1536)]
    # The kernel audit: on CPU every hot op of every layer ran its reference (tiny: 3 KDA layers, 1 DSA).
    assert doc["meta"]["kernels"]["kda"] == {"reference": 3}
    assert set(doc["meta"]["kernels"]["dsa_sparse_attention"]) == {"reference"}
    partial = [json.loads(line) for line in (out / "partial.jsonl").read_text().splitlines()[1:]]

    pg = open_prepared(world["data"])
    steps = {"baseline": 0, "checkpoint": 3}
    n_buckets = SEQ // BUCKET
    for role, step in steps.items():
        model = from_pretrained(world["run"] / f"checkpoints/step_{step:08d}/model", dtype=torch.float32)
        sums, counts = np.zeros(n_buckets), np.zeros(n_buckets)
        for w in doc["windows"]:
            tokens, _ = pg.read("holdout", w["record"], w["start"], SEQ)
            full = direct_full(model, tokens)
            for j in range(1, SEQ):
                if tokens[j] != N_ID:
                    sums[j // BUCKET] += full[j - 1]
                    counts[j // BUCKET] += 1
        row = next(r for r in doc["bits_per_base"] if (r["model"], r["context"], r["bases"]) == (role, "full", "all"))
        np.testing.assert_allclose(row["value"], sums / counts, rtol=2e-5)
        assert doc["n_tokens"]["all"] == counts.astype(int).tolist()

        # Control, per target, for the last bucket of the first window (from the per-window partial file).
        tokens, _ = pg.read("holdout", "chr22", 0, SEQ)
        last = range(SEQ - BUCKET, SEQ)
        expect = sum(direct_control(model, tokens, [j for j in last if tokens[j] != N_ID]).values())
        line = next(p for p in partial if p["model"] == role and p["start"] == 0)
        assert sum(line["sums"][1][c][-1] for c in range(2)) == pytest.approx(expect, rel=2e-5)
        # targets before the first control block have under C tokens of context: control == full
        assert sum(line["sums"][1][c][0] for c in range(2)) == pytest.approx(sum(line["sums"][0][c][0] for c in range(2)))
    for name in ("positional.csv", "positional.png", "summary.txt"):
        assert (out / name).is_file()

    # Markov rows: the same targets; its fit is cached beside the outputs.
    markov_row = next(r for r in doc["bits_per_base"] if (r["model"], r["bases"]) == ("markov", "all"))
    assert all(1.0 < v < 2.5 for v in markov_row["value"]) and (out / "markov.npz").is_file()

    # A rerun finds every window done and rewrites the same tables without loading a model or refitting.
    before = (out / "positional.csv").read_text()
    monkeypatch.setattr("genolong.eval.models.load", lambda *a, **k: pytest.fail("nothing left to score"))
    monkeypatch.setattr("genolong.eval.markov.fit", lambda *a, **k: pytest.fail("the Markov fit is cached"))
    code, _, err = genolong(
        monkeypatch, capsys, "eval-positional", "--data", world["data"], "--checkpoint", world["run"], "--out", out, *ARGS
    )
    assert code == 0, err
    assert (out / "positional.csv").read_text() == before


def bad(world, tmp_path, **over):
    args = {
        "--data": world["data"], "--checkpoint": world["run"] / "checkpoints/step_00000003", "--baseline": world["base"],
        "--seq": "512", "--bucket": "128", "--out": tmp_path / "e",
    }
    args.update(over)
    flat = [x for k, v in args.items() if v is not None for x in (k, v)]
    return ["eval-positional", *flat, "--no-progress"]


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"--data": "nowhere"}, "--data nowhere: no such directory"),
        ({"--checkpoint": "nowhere"}, "--checkpoint nowhere: no such file or directory"),
        ({"--bucket": "1k"}, "--bucket 1k is larger than the window --seq 512"),
        ({"--seq": "8k", "--bucket": "1k"}, "no record in split 'holdout'"),
        ({"--checkpoint": "RUN@7"}, "no complete checkpoint of step 7 (steps saved: 0, 3)"),
        ({"--baseline": "OTHER_ARCH"}, "different architectures (num_layers: 2 vs 4)"),
        ({"--baseline": "OTHER_VOCAB"}, "use different vocabularies (DNA bases map to token ids [11, 12, 13, 14, 15] vs [0, 1, 2, 3, 4])"),
    ],
)
def test_bad_input_is_one_clear_line(world, monkeypatch, capsys, tmp_path, over, needle):
    if over.get("--checkpoint") == "RUN@7":
        over = {"--checkpoint": f"{world['run']}@7"}
    if over.get("--baseline") == "OTHER_ARCH":
        over = {"--baseline": _model(tmp_path / "two_layers", 0, num_layers=2)}
    if over.get("--baseline") == "OTHER_VOCAB":
        # a GLM-style checkpoint: its own vocabulary, bases found through its tokenizer.json
        path = _model(tmp_path / "vocab16", 0, vocab_size=16)
        vocab = {tok: i for i, tok in enumerate(["<pad>", *"BDEFHIJKLM", *"ACGTN"])}
        (path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
        over = {"--baseline": path}
    code, _, err = genolong(monkeypatch, capsys, *bad(world, tmp_path, **over))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("genolong: error:"), err
    assert needle in lines[0]
    assert not (tmp_path / "e" / "positional.json").exists()


def test_a_missing_checkpoint_is_reported_before_the_default_bucket(world, monkeypatch, capsys, tmp_path):
    # --seq under 32k without --bucket: the real problem (no such checkpoint) is what the line names.
    code, _, err = genolong(monkeypatch, capsys, *bad(world, tmp_path, **{"--checkpoint": "nowhere", "--bucket": None}))
    assert code == 2 and "--checkpoint nowhere: no such file or directory" in err and "--bucket" not in err, err


def test_the_default_bucket_follows_a_short_seq(world, monkeypatch, capsys, tmp_path):
    out = tmp_path / "e"
    args = bad(world, tmp_path, **{"--bucket": None, "--out": out})
    code, _, err = genolong(monkeypatch, capsys, *args, "--controls", "none", "--bootstrap", "20", "--max-windows", "1",
                            "--max-n-fraction", "0.5", "--markov-max-order", "2")
    assert code == 0, err
    assert json.loads((out / "positional.json").read_text())["bucket"] == 512 // 16


def test_ctrl_c_prints_one_line_and_exits_130(world, monkeypatch, capsys, tmp_path):
    from genolong.eval import run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "evaluate", interrupted)
    code, _, err = genolong(monkeypatch, capsys, *bad(world, tmp_path))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 130 and len(lines) == 1 and lines[0].startswith("genolong: interrupted;"), err
    assert "run the same command again to continue" in lines[0]


def test_a_second_checkpoint_is_refused_not_silently_dropped(world, monkeypatch, capsys, tmp_path):
    args = bad(world, tmp_path)
    args[args.index("--checkpoint") + 1 : args.index("--checkpoint") + 1] = [str(world["run"]), "--checkpoint"]
    code, _, err = genolong(monkeypatch, capsys, *args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "--checkpoint given 2 times" in lines[0], err
    assert "run it once per model" in lines[0]
    assert not (tmp_path / "e" / "positional.json").exists()


def test_no_usable_window(world, monkeypatch, capsys, tmp_path):
    # The only 3k tile (chr22 at 0) overlaps the N run at 1500-1700; chrY is shorter than 3k.
    code, _, err = genolong(monkeypatch, capsys, *bad(world, tmp_path, **{"--seq": "3k", "--max-n-fraction": "0"}))
    assert code == 2
    assert "has no window of 3k with at most 0% N (records: chr22 3,500 bp, chrY 900 bp)" in err


def test_every_way_of_naming_a_checkpoint(world):
    from genolong.eval import models

    run = world["run"]
    for text, label in (
        (str(run), "run step 3"),
        (f"{run}@latest", "run step 3"),
        (f"{run}@0", "run step 0"),
        (str(run / "checkpoints/step_00000003"), "run step 3"),
        (str(run / "checkpoints/step_00000003/model"), "run step 3"),
        (str(world["base"]), "base"),
    ):
        resolved = models.resolve(text, "--checkpoint")
        assert resolved.spec.label == label, text
        assert (resolved.model_dir / "config.json").is_file()
        assert resolved.spec.token_map == [0, 1, 2, 3, 4]
    # the default baseline of a run is its step 0
    assert models.default_baseline(str(run)).spec.label == "run step 0"


def test_a_dna_vocabulary_checkpoint_is_scored_through_its_own_tokenizer(tmp_path):
    # A checkpoint from outside genolong with the 8-token DNA vocabulary but another base order:
    # its tokenizer.json decides which rows are A, C, G, T, N (as finetune --model reads it).
    from genolong.eval import models
    from genolong.model.vocab import dna_to_checkpoint_ids

    model = GenoLongForCausalLM(get_preset("tiny"))
    save_pretrained(model, tmp_path / "m")
    assert models.resolve(str(tmp_path / "m"), "--baseline").spec.token_map == [0, 1, 2, 3, 4]
    vocab = {"T": 0, "G": 1, "C": 2, "A": 3, "N": 4}
    (tmp_path / "m" / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab}}))
    spec = models.resolve(str(tmp_path / "m"), "--baseline").spec
    assert spec.token_map == [3, 2, 1, 0, 4] == dna_to_checkpoint_ids(tmp_path / "m").tolist()


def test_default_baseline_without_step_0(world, tmp_path):
    from genolong.errors import GenolongError
    from genolong.eval import models

    run = tmp_path / "later"
    run.mkdir()
    model = GenoLongForCausalLM(get_preset("tiny"))
    ckpt_io.save(run, 5, lambda p: save_pretrained(model, p), {}, {"step": 5, "dna_token_ids": None}, keep_last=1)
    (run / ckpt_io.OPTIONS_FILE).write_text(json.dumps({"preset": None, "model_path": str(world["base"])}))
    assert models.default_baseline(str(run)).model_dir == world["base"]  # the model the run started from
    # An older run's path as typed, relative to a directory we are not in: a one-line error naming it.
    (run / ckpt_io.OPTIONS_FILE).write_text(json.dumps({"preset": None, "model_path": "runs/a/checkpoints/step_00000002/model"}))
    with pytest.raises(GenolongError, match="started from the model 'runs/a/.*options.json model_path.*pass that model with --baseline"):
        models.default_baseline(str(run))
    (run / ckpt_io.OPTIONS_FILE).write_text(json.dumps({"preset": "tiny", "model_path": None}))
    with pytest.raises(GenolongError, match="--baseline is needed: run .* started from preset 'tiny'"):
        models.default_baseline(str(run))
    with pytest.raises(GenolongError, match="--baseline is needed"):
        models.default_baseline(str(world["base"]))


def test_interrupted_run_resumes_to_the_same_tables(world, monkeypatch, capsys, tmp_path):
    import genolong.eval.run as run_mod

    args = ("eval-positional", "--data", world["data"], "--checkpoint", world["run"], *ARGS, "--controls", "truncated")
    code, _, err = genolong(monkeypatch, capsys, *args, "--out", tmp_path / "whole")
    assert code == 0, err

    real = run_mod.score_window
    calls = {"n": 0}

    def dies_on_the_sixth(*a, **k):
        calls["n"] += 1
        if calls["n"] == 6:  # the checkpoint's second window (the baseline scored 4)
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(run_mod, "score_window", dies_on_the_sixth)
    code, _, err = genolong(monkeypatch, capsys, *args, "--out", tmp_path / "cut")
    assert code == 130, err
    assert not (tmp_path / "cut" / "positional.json").exists()
    monkeypatch.setattr(run_mod, "score_window", real)

    scored = []
    monkeypatch.setattr(run_mod, "score_window", lambda *a, **k: scored.append(1) or real(*a, **k))
    code, _, err = genolong(monkeypatch, capsys, *args, "--out", tmp_path / "cut")
    assert code == 0, err
    assert len(scored) == 3  # only the checkpoint's windows 2-4
    assert (tmp_path / "cut" / "positional.csv").read_text() == (tmp_path / "whole" / "positional.csv").read_text()


def test_a_copied_run_resumes_and_a_changed_checkpoint_is_refused(world, monkeypatch, capsys, tmp_path):
    args = ("eval-positional", "--data", world["data"], *ARGS, "--max-windows", "2", "--controls", "truncated")
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    code, _, err = genolong(monkeypatch, capsys, *args, "--checkpoint", run, "--out", tmp_path / "e")
    assert code == 0, err

    # The run directory moved elsewhere (new path, new mtimes): the same models, nothing to rescore.
    moved = tmp_path / "moved" / "run"
    shutil.copytree(run, moved)
    for p in moved.rglob("*"):
        p.touch()
    shutil.rmtree(run)
    with monkeypatch.context() as m:
        m.setattr("genolong.eval.models.load", lambda *a, **k: pytest.fail("the copied models were rescored"))
        code, _, err = genolong(monkeypatch, capsys, *args, "--checkpoint", moved, "--out", tmp_path / "e")
    assert code == 0, err

    # One byte of the checkpoint's weights changed: another model, refused without --overwrite.
    weights = moved / "checkpoints/step_00000003/model/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    code, _, err = genolong(monkeypatch, capsys, *args, "--checkpoint", moved, "--out", tmp_path / "e")
    assert code == 2 and "different evaluation (models.checkpoint.fingerprint" in err


def test_a_text_vocabulary_checkpoint_is_scored_over_its_base_tokens(world, monkeypatch, capsys, tmp_path):
    """A GLM-style checkpoint: 16 tokens, bases at ids 11-15 (its tokenizer.json); probability on
    the other tokens does not count against it."""
    vocab = {tok: i for i, tok in enumerate(["<pad>", *"BDEFHIJKLM", *"ACGTN"])}
    dirs = []
    for seed in (0, 1):
        path = _model(tmp_path / f"glm{seed}", seed, vocab_size=16)
        (path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
        dirs.append(path)
    out = tmp_path / "e"
    code, _, err = genolong(
        monkeypatch, capsys, "eval-positional", "--data", world["data"], "--baseline", dirs[0], "--checkpoint", dirs[1],
        "--out", out, *ARGS, "--max-windows", "1", "--control-context", "0",
    )
    assert code == 0, err
    doc = json.loads((out / "positional.json").read_text())
    pg = open_prepared(world["data"])
    tokens, _ = pg.read("holdout", "chr22", 0, SEQ)
    for role, path in (("baseline", dirs[0]), ("checkpoint", dirs[1])):
        bits = direct_full(from_pretrained(path, dtype=torch.float32), tokens, token_map=(11, 12, 13, 14, 15))
        valid = tokens[1:] != N_ID
        expect = [bits[(np.arange(1, SEQ) // BUCKET == b) & valid].mean() for b in range(SEQ // BUCKET)]
        row = next(r for r in doc["bits_per_base"] if (r["model"], r["context"], r["bases"]) == (role, "full", "all"))
        np.testing.assert_allclose(row["value"], expect, rtol=2e-5)


def test_an_unknown_control_is_one_clear_line(world, monkeypatch, capsys, tmp_path):
    code, _, err = genolong(monkeypatch, capsys, *bad(world, tmp_path), "--controls", "truncated,reversed")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "unknown control 'reversed'; use truncated, shuffled, both (truncated,shuffled) or none" in err


def test_late_controls_give_the_same_long_range_part_at_a_fraction_of_the_cost(world, monkeypatch, capsys, tmp_path):
    """--controls-at late: the summary's late-bucket numbers are the every-bucket run's (the blocks
    are the same when the bucket is a multiple of C), the other buckets' control rows are empty
    (null, not a made-up number) in the JSON and CSV, the plot and summary are written, and fewer
    tokens run."""
    docs = {}
    for at in ("all", "late"):
        out = tmp_path / at
        code, stdout, err = genolong(
            monkeypatch, capsys, "eval-positional", "--data", world["data"], "--checkpoint", world["run"], "--out", out,
            *ARGS, "--max-windows", "2", "--controls-at", at,
        )
        assert code == 0, err
        assert "long-range part" in stdout and "nan" not in stdout.lower()
        assert ("controls re-score the last bucket only" in stdout) == (at == "late")
        docs[at] = json.loads((out / "positional.json").read_text())
        assert (out / "positional.png").is_file() and (out / "summary.txt").is_file()
    every, late = docs["all"], docs["late"]
    assert late["controls_at"] == "late" and every["controls_at"] == "all"
    keys = ("long_range_late_truncated", "long_range_late_shuffled", "late_rel_change_shuffled", "long_range_late_truncated_repeat")
    for key in keys:
        for part in ("value", "lo", "hi"):
            assert late["summary"][key][part] == pytest.approx(every["summary"][key][part], rel=1e-6), key
    row = next(r for r in late["bits_per_base"] if (r["model"], r["context"], r["bases"]) == ("checkpoint", "shuffled", "all"))
    assert row["value"][:-1] == [None] * (SEQ // BUCKET - 1) and row["value"][-1] is not None
    full_tokens = {at: sum(d["meta"]["forward_tokens_per_window"].values()) for at, d in docs.items()}
    assert full_tokens["late"] < full_tokens["all"]
    csv_text = (tmp_path / "late" / "positional.csv").read_text()
    assert "nan" not in csv_text.lower()
