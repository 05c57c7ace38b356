"""pipelines/longrange.sh, CPU-sized, end to end on the bundled genome: every stage runs, the
evaluations write their tables, the comparison arms (indexer frozen; the long stage's tokens in
short windows) train as meant, and a rerun skips what is done (the recipe resumes after an
interruption)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]

# The header's CPU-sized variant, on the bundled genome (E. coli trains, phage lambda is held out).
CPU_SIZED = {
    "FASTA": "bundled", "ASSEMBLY": "bundled", "PRESET": "tiny", "LAYERS": "4", "COPY_SEQ": "512", "COPY_BATCH": "4",
    "COPY_STEPS": "8", "COPY_TOPK": "16", "WIDE_SEQ": "1k", "WIDE_STEPS": "2", "OWN_SEQ": "2k", "OWN_STEPS": "2",
    "SEQ": "4k", "SHORT_SEQ": "1k", "STEPS": "2", "BUCKET": "1k", "CONTROL": "1k", "MAX_WINDOWS": "3", "RECALL_WINDOWS": "2",
    "MEMORY_FLAGS": "--no-recompute", "FINETUNE_FLAGS": "--no-progress",
}


def _pipeline(tree, **settings):
    env = {**os.environ, **CPU_SIZED, "GENOLONG": f"{sys.executable} -m genolong", **settings}
    out = subprocess.run(["bash", "pipelines/longrange.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _indexer_weights(model_dir):
    weights = {}
    for f in Path(model_dir).glob("*.safetensors"):
        weights.update({k: v for k, v in load_file(f).items() if ".indexer." in k})
    assert weights, f"no indexer weights in {model_dir}"
    return weights


def _tree(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "pipelines", tree / "pipelines")
    return tree


def _same_indexer(tree, tag):
    """Whether the indexer's weights are the same in the copy stage's model and the own stage's."""
    before, after = _indexer_weights(tree / f"runs/{tag}-copy/model"), _indexer_weights(tree / f"runs/{tag}-own/model")
    assert before.keys() == after.keys()
    return all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow(seconds=25)
def test_the_frozen_arm_keeps_the_indexer_in_every_stage(tmp_path):
    # The fewest steps that still pass through every stage up to own: the check is the indexer's weights.
    tree = _tree(tmp_path)
    # INDEXER_QUERIES reaches both arms from the two-arm script: the frozen arm has no loss to subsample
    # (finetune refuses the flag with a frozen indexer), so the pipeline must leave it out there.
    frozen = _pipeline(tree, INDEXER_COEFF="0", INDEXER_QUERIES="0.5", TAG="lr-frozen", UNTIL="own", COPY_STEPS="2",
                       WIDE_STEPS="1", OWN_STEPS="1")
    assert "done (UNTIL=own)" in frozen
    assert _same_indexer(tree, "lr-frozen"), "INDEXER_COEFF=0 left the indexer training"


@pytest.mark.slow(seconds=95)
def test_the_cpu_sized_pipeline_runs_every_stage_and_resumes(tmp_path):
    tree = _tree(tmp_path)
    log = _pipeline(tree, TAG="lr", INDEXER_QUERIES="0.5")
    for n in range(1, 9):
        assert f"] {n}/8 " in log
    assert "6/8 short: the comparison arm, 2 steps of 4 x 1k" in log
    doc = json.loads((tree / "eval/lr/positional.json").read_text())
    assert doc["controls"] == ["truncated", "shuffled"] and doc["controls_at"] == "late"
    assert doc["summary"]["n_windows"] == 3
    assert doc["summary"]["long_range_late_shuffled"]["value"] is not None
    # the short stage's model is the baseline: long windows against the same tokens in short ones
    assert doc["meta"]["models"]["baseline"]["source"].endswith("runs/lr-short")
    short = [json.loads(line) for line in (tree / "runs/lr-short/metrics.jsonl").read_text().splitlines()]
    long_ = [json.loads(line) for line in (tree / "runs/lr-long/metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in short] == [r["tokens"] for r in long_] == [4096, 4096]
    recall = json.loads((tree / "eval/lr-recall/recall.json").read_text())
    assert recall["windows"] or recall.get("n_windows")
    assert not _same_indexer(tree, "lr")  # the trained arm's indexer learns
    # the query subset reaches the stages after the oracle's, and only those
    queries = {stage: json.loads((tree / f"runs/lr-{stage}/options.json").read_text())["indexer_loss_queries"]
               for stage in ("copy", "widen", "own", "long", "short")}
    assert queries == {"copy": 1.0, "widen": 1.0, "own": 0.5, "long": 0.5, "short": 0.5}

    # A rerun: every training stage is skipped, the evaluations are reused.
    again = _pipeline(tree, TAG="lr", INDEXER_QUERIES="0.5")
    assert again.count("finished") >= 5 and "step 1/" not in again

    # A short stage that cannot read the long stage's tokens is refused in one line, before any stage.
    env = {**os.environ, **CPU_SIZED, "GENOLONG": f"{sys.executable} -m genolong", "TAG": "lr", "SHORT_SEQ": "3k"}
    bad = subprocess.run(["bash", "pipelines/longrange.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "SHORT_SEQ=3k must divide SEQ=4k" in bad.stderr and "1/8" not in bad.stdout
