"""The copy-task indexer experiment's tools (benchmarks/copy_task_probe.py, copy_indexer_arms.py,
plot_copy_arms.py): the oracle selection holds what a copy query needs and nothing it cannot see, a
time budget stops a probe with its model and curve written, and the arms run end to end."""

import json
import subprocess
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from copy_task_probe import copy_batch, oracle_topk  # noqa: E402


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
