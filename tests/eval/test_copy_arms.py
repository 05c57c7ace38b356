"""The copy-task indexer experiment's tools (benchmarks/copy_task_probe.py, copy_indexer_arms.py,
plot_copy_arms.py): the oracle selection holds what a copy query needs and nothing it cannot see, a
time budget stops a probe with its model and curve written, and the arms run end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from copy_task_probe import copy_batch, oracle_topk  # noqa: E402

from genolong.data import prepare  # noqa: E402
from genolong.vocab import N_ID  # noqa: E402


def _check_rows(ids, first, copy, layout, length):
    rows = torch.arange(ids.shape[0])[:, None]
    offsets = torch.arange(length)
    start, copy_start = layout["start"], layout["copy_start"]
    assert bool((start >= 0).all()) and bool((copy_start + length <= ids.shape[1]).all())
    assert torch.equal(ids[rows, copy_start[:, None] + offsets], ids[rows, start[:, None] + offsets])
    # the masks pick, among the next-base targets ids[:, 1:], the copy's L bases and the first L-mer's
    # last L - 1 (its first base has nothing before it to predict it from), in order
    batch, targets = ids.shape[0], ids[:, 1:]
    assert torch.equal(copy.sum(1), torch.full((batch,), length)) and torch.equal(first.sum(1), torch.full((batch,), length - 1))
    source = ids[rows, start[:, None] + offsets]
    assert torch.equal(targets[copy].view(batch, length), source)
    assert torch.equal(targets[first].view(batch, length - 1), source[:, 1:])


def test_copies_end_the_row_by_default_and_anywhere_in_a_window():
    torch.manual_seed(0)
    length, gap = 8, 40
    layout: dict = {}
    ids, first, copy = copy_batch(64, length, gap, layout)
    _check_rows(ids, first, copy, layout, length)
    assert bool((layout["copy_start"] + length == ids.shape[1]).all())  # without a window the copy ends each row
    ids, first, copy = copy_batch(64, length, gap, layout, window=300)
    assert ids.shape == (64, 300)
    _check_rows(ids, first, copy, layout, length)
    ends = layout["copy_start"] + length
    # uniform placement: copies end early and late in the row, and the distances still span [L, L + G]
    assert int(ends.min()) < 150 and int(ends.max()) > 250
    distance = layout["copy_start"] - layout["start"]
    assert int(distance.min()) >= length and int(distance.max()) <= length + gap and distance.unique().numel() > 10


@pytest.fixture(scope="module")
def genome(tmp_path_factory):
    """A prepared two-record genome: chr1 (train) with a run of N in its middle, chr22 (holdout)."""
    root = tmp_path_factory.mktemp("copydna")
    rng = torch.Generator().manual_seed(0)
    bases = "".join("ACGT"[int(i)] for i in torch.randint(0, 4, (3000,), generator=rng))
    chrom = bases[:1000] + "N" * 400 + bases[1400:]  # room for N-free rows only on either side of the N run
    (root / "g.fa").write_text(f">chr1\n{chrom}\n>chr22\n{bases[:600]}\n")
    prepare(root / "g.fa", root / "data", train="chr1", holdout="chr22", progress=False, log=lambda _: None)
    return root / "data", chrom


def test_dna_rows_come_from_the_genome_and_hold_no_n(genome):
    from copy_dna import DnaRows

    data, chrom = genome
    source = DnaRows(str(data), "train", seed=3)
    rows = source.rows(16, 200)
    assert rows.shape == (16, 200) and rows.dtype == torch.int64
    assert not bool((rows == N_ID).any()) and bool((rows < 4).all())
    complement = str.maketrans("ACGT", "TGCA")
    for row in rows:
        text = "".join("ACGT"[int(i)] for i in row)
        # a window of the genome, on either strand
        assert text in chrom or text.translate(complement)[::-1] in chrom, "a row that is not a window of the genome"
    assert not torch.equal(rows, source.rows(16, 200))  # a stream: the next rows are other windows
    # the planted copy is real DNA too
    layout: dict = {}
    ids, first, copy = copy_batch(4, 16, 100, layout, source=source.rows, window=300)
    _check_rows(ids, first, copy, layout, 16)
    assert not bool((ids == N_ID).any())


def test_oracle_selection_holds_the_needed_key_and_only_visible_keys():
    torch.manual_seed(0)
    layout: dict = {}
    length, gap, kpool, topk_pools = 16, 40, 4, 3
    ids, _first, copy = copy_batch(5, length, gap, layout)
    seq = ids.shape[1] - 1
    select = oracle_topk(layout)
    out = select(torch.zeros(5, seq, 1, 1), None, None, kpool=kpool, topk_pools=topk_pools,
                 always_select_tail=True, softmax_scale=1.0)
    assert out.shape == (5, seq, topk_pools * kpool + kpool - 1) and out.dtype == torch.int32
    t = torch.arange(seq)
    # causal: nothing after the query; every listed key once
    assert bool(((out <= t[None, :, None]) | (out == -1)).all())
    for row in out.reshape(-1, out.shape[-1]):
        kept = row[row >= 0]
        assert kept.unique().numel() == kept.numel()
    # every copy query (predicting copy base j from position t) holds the source base it needs
    needed = t[None, :] - (layout["copy_start"][:, None] - layout["start"][:, None]) + 1
    held = (out == needed.unsqueeze(-1)).any(-1)
    inside = copy[:, : seq]  # the copy's targets, as positions of the query that predicts them
    assert bool(held[inside].all())
    # and outside the copy the pools are random: the needed index is not systematically there
    assert float(held[~inside & (t[None, :] > length)].float().mean()) < 0.9


def _run(*args, cwd):
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_probe_budget_then_arms_then_plot(tmp_path):
    over = '{"hidden": 32, "dsa": {"num_heads": 2, "kv_lora_rank": 16, "indexer": {"topk": 8}}}'
    probe = _run(BENCH / "copy_task_probe.py", "--model", "tiny", "--overrides", over, "--hold-dsa-post",
                 "--oracle-selection", "--steps", "100000", "--budget-s", "1", "--every", "1000", "--loss-on", "copy",
                 "--length", "16", "--max-gap", "32", "--batch", "2", "--save", tmp_path / "A",
                 "--out", tmp_path / "A.json", cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-2000:]
    record = json.loads((tmp_path / "A.json").read_text())
    assert record["stopped_for_time"] and 0 < record["steps_done"] < 100000
    assert record["curve"][-1][0] == record["steps_done"] - 1  # the curve ends where it stopped
    assert (tmp_path / "A" / "config.json").exists()

    arms = _run(BENCH / "copy_indexer_arms.py", "--model", tmp_path / "A", "--topk", "8", "--length", "16",
                "--max-gap", "32", "--gaps", "0,32", "--warmup-steps", "2", "--sparse-steps", "2", "--batch", "2",
                "--eval-batches", "1", "--eval-rows", "2", "--every", "1", "--out", tmp_path / "arms.json", cwd=tmp_path)
    assert arms.returncode == 0, arms.stderr[-2000:]
    result = json.loads((tmp_path / "arms.json").read_text())
    seen = {(r["arm"], r["selection"], r["distance"]) for r in result["rows"]}
    for arm in ("frozen", "warmup", "warmup+sparse"):
        assert {(arm, "indexer", 16), (arm, "indexer", 48)} <= seen
    assert {("frozen", "oracle", 48), ("frozen", "dense", 48)} <= seen
    for r in result["rows"]:
        assert r["copy_bits"] > 0
        if r["selection"] == "indexer":
            assert 0.0 <= r["needed_key_selected"] <= 1.0
    assert len(result["curves"]["warmup"]) == 2 and len(result["curves"]["sparse"]) == 2

    # without a warm-up: no warm-up arm, and the sparse-only arm is labelled as such
    sparse = _run(BENCH / "copy_indexer_arms.py", "--model", tmp_path / "A", "--topk", "8", "--length", "16",
                  "--max-gap", "32", "--gaps", "32", "--warmup-steps", "0", "--sparse-steps", "1", "--batch", "2",
                  "--eval-batches", "1", "--eval-rows", "2", "--out", tmp_path / "sparse.json", cwd=tmp_path)
    assert sparse.returncode == 0, sparse.stderr[-2000:]
    only = json.loads((tmp_path / "sparse.json").read_text())
    assert {r["arm"] for r in only["rows"]} == {"frozen", "sparse"} and set(only["curves"]) == {"sparse"}

    plot = _run(BENCH / "plot_copy_arms.py", tmp_path / "arms.json", "--out", tmp_path / "arms.png", cwd=tmp_path)
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert (tmp_path / "arms.png").stat().st_size > 10_000


def test_probe_and_arms_on_dna_with_copies_anywhere(tmp_path, genome):
    data, _ = genome
    over = '{"hidden": 32, "dsa": {"num_heads": 2, "kv_lora_rank": 16}}'
    probe = _run(BENCH / "copy_task_probe.py", "--model", "tiny", "--overrides", over, "--hold-dsa-post", "--dna", data,
                 "--loss-on", "mix", "--window", "120", "--steps", "2", "--every", "1", "--length", "16", "--max-gap", "40",
                 "--batch", "2", "--save", tmp_path / "A", "--out", tmp_path / "A.json", cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-2000:]
    curve = json.loads((tmp_path / "A.json").read_text())["curve"]
    assert len(curve) == 2 and all(0 < c[4] < 8 for c in curve)  # the loss outside the copy (the DNA) is logged
    arms = _run(BENCH / "copy_indexer_arms.py", "--model", tmp_path / "A", "--topk", "8", "--length", "16", "--max-gap", "40",
                "--window", "120", "--gaps", "0,40", "--dna", data, "--warmup-steps", "1", "--sparse-steps", "1", "--batch", "2",
                "--eval-batches", "1", "--eval-rows", "2", "--save-arms", tmp_path / "arms", "--out", tmp_path / "arms.json",
                cwd=tmp_path)
    assert arms.returncode == 0, arms.stderr[-2000:]
    rows = json.loads((tmp_path / "arms.json").read_text())["rows"]
    assert all(0 < r["first_bits"] < 8 and 0 < r["copy_bits"] < 8 for r in rows)
    by = {(r["arm"], r["selection"], r["distance"]) for r in rows}
    assert {("frozen", "oracle", 56), ("frozen", "dense", 56), ("warmup+sparse", "indexer", 56)} <= by
    # the saved arms: the frozen one is the model as given; the trained ones differ from it in the indexer alone
    from genolong.model import from_pretrained

    given = from_pretrained(tmp_path / "A", dtype=torch.float32).state_dict()
    for arm in ("frozen", "warmup", "warmup_sparse"):
        saved = from_pretrained(tmp_path / "arms" / arm, dtype=torch.float32).state_dict()
        moved = {name for name in given if not torch.equal(given[name], saved[name])}
        if arm == "frozen":
            assert not moved
        else:
            assert moved and all(".self_attn.indexer." in name for name in moved), sorted(moved)[:5]
    plot = _run(BENCH / "plot_copy_arms.py", tmp_path / "arms.json", "--out", tmp_path / "arms.png", cwd=tmp_path)
    assert plot.returncode == 0, plot.stderr[-2000:]


@pytest.mark.slow  # ~70 s on one CPU thread
def test_trained_indexer_recalls_on_held_out_dna_where_the_frozen_one_does_not(tmp_path):
    """The experiment in small (docs/recall.md, "On real DNA"): the committed DNA copier, 60 dense warm-up
    steps of its indexer alone on E. coli, scored on held-out phage lambda copies 1,024 bases back in
    1,088-token windows at top-k 64 (6% of the keys). Frozen, the selection rarely holds the source
    and the copy costs about what its first occurrence does; trained, it is found and copied."""
    from genolong.data import BUNDLED_HOLDOUT, BUNDLED_TRAIN, bundled_genome_path

    prepare(bundled_genome_path(), tmp_path / "data", train=BUNDLED_TRAIN, holdout=BUNDLED_HOLDOUT, progress=False,
            log=lambda _: None)
    model = BENCH / "recall_cpu_indexer" / "gpu_dna" / "J1088"
    arms = _run(BENCH / "copy_indexer_arms.py", "--model", model, "--topk", "64", "--dna", tmp_path / "data",
                "--window", "1088", "--max-gap", "960", "--gaps", "960", "--warmup-steps", "60", "--sparse-steps", "0",
                "--batch", "8", "--eval-batches", "1", "--out", tmp_path / "arms.json", cwd=tmp_path)
    assert arms.returncode == 0, arms.stderr[-2000:]
    rows = {(r["arm"], r["selection"]): r for r in json.loads((tmp_path / "arms.json").read_text())["rows"]}
    frozen, trained = rows[("frozen", "indexer")], rows[("warmup", "indexer")]
    assert frozen["needed_key_selected"] < 0.15 and trained["needed_key_selected"] > 0.35
    assert frozen["copy_bits"] > frozen["first_bits"] - 0.3  # the frozen arm: hardly better than not copying
    assert trained["copy_bits"] < trained["first_bits"] - 0.7  # the trained arm copies
    assert rows[("frozen", "oracle")]["copy_bits"] < 0.3  # and the copier itself copies when given the source
