"""pipelines/lib.sh: a training stage is started, continued, started again or skipped, from what
its run directory holds (the pipelines recover from an interruption by themselves)."""

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _stage(tmp_path, run, steps=4):
    """What finetune_or_resume runs for RUN, with `genolong` replaced by a command that prints its arguments."""
    script = f'cd {ROOT}; GENOLONG="echo genolong"; source pipelines/lib.sh; DATA=data/x; finetune_or_resume {run} {steps} --preset tiny'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()


def _checkpoint(run, step, complete=True):
    path = run / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    if complete:
        (path / "COMPLETE").write_text(json.dumps({"step": step, "files": {}}))


@pytest.fixture
def run(tmp_path):
    return tmp_path / "run"


def test_a_new_run_starts(tmp_path, run):
    assert _stage(tmp_path, run) == [f"genolong finetune --data data/x --steps 4 --out {run} --preset tiny"]


def test_a_run_stopped_before_its_first_checkpoint_starts_again_with_overwrite(tmp_path, run):
    run.mkdir()
    (run / "options.json").write_text("{}")
    _checkpoint(run, 2, complete=False)  # a save that never finished does not count
    lines = _stage(tmp_path, run)
    assert lines[-1] == f"genolong finetune --data data/x --steps 4 --out {run} --overwrite --preset tiny"
    assert "starting it again" in lines[0]


def test_a_run_with_a_checkpoint_continues_and_a_finished_one_is_skipped(tmp_path, run):
    run.mkdir()
    (run / "options.json").write_text("{}")
    _checkpoint(run, 2)
    assert _stage(tmp_path, run)[-1] == f"genolong finetune --resume {run} --steps 4 --preset tiny"
    _checkpoint(run, 4)
    assert _stage(tmp_path, run) == [f"{run}: finished (4 steps), skipped"]
    # A longer run asked for later continues the finished one.
    assert _stage(tmp_path, run, steps=6)[-1] == f"genolong finetune --resume {run} --steps 6 --preset tiny"


def _lib(script):
    full = f'cd {ROOT}; set -euo pipefail; GENOLONG="echo genolong"; source pipelines/lib.sh; DATA=data/x; {script}'
    return subprocess.run(["bash", "-c", full], capture_output=True, text=True, check=True).stdout.strip().splitlines()


def _model(run, step, weights):
    model = run / "checkpoints" / f"step_{step:08d}" / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(weights)


def test_model_of_copies_once_and_replaces_a_copy_of_other_weights(tmp_path, run):
    dest = tmp_path / "start-model"
    _model(run, 4, b"stage one")
    first = _lib(f"model_of {run} 4 {dest}; echo changed=$CHANGED")
    assert first == ["changed=0"] and (dest / "model.safetensors").read_bytes() == b"stage one"
    assert f"{run} step 4 cksum" in (dest / "SOURCE").read_text()
    assert _lib(f"model_of {run} 4 {dest}; echo changed=$CHANGED") == ["changed=0"]  # the same model: kept
    # Trained further (another step) or again from scratch (other weights, same step): replaced.
    _model(run, 6, b"stage one, longer")
    lines = _lib(f"model_of {run} 6 {dest}; echo changed=$CHANGED; overwrite_if_changed")
    assert "replaced by" in lines[0] and lines[1:] == ["changed=1", "--overwrite"]
    _model(run, 6, b"retrained from scratch")
    assert "replaced by" in _lib(f"model_of {run} 6 {dest}")[0]
    assert (dest / "model.safetensors").read_bytes() == b"retrained from scratch"
    assert not (tmp_path / "start-model.tmp").exists()


def test_a_stage_started_from_a_since_replaced_model_trains_again(tmp_path, run):
    stage1, start = tmp_path / "stage1", tmp_path / "start-model"
    _model(stage1, 4, b"v1")
    # The first pass: the copy, then stage 2 started from it (the fake genolong makes no run
    # directory: made here, as finetune would, then finished).
    _lib(f"model_of {stage1} 4 {start}")
    run.mkdir()
    lines = _lib(f"finetune_or_resume {run} 3 --model {start}; echo changed=$CHANGED")
    assert lines == [f"genolong finetune --data data/x --steps 3 --out {run} --model {start}", "changed=1"]
    assert (run / "START_MODEL").read_text() == (start / "SOURCE").read_text()
    (run / "options.json").write_text("{}")
    _checkpoint(run, 3)
    assert _lib(f"finetune_or_resume {run} 3 --model {start}; echo changed=$CHANGED") == [f"{run}: finished (3 steps), skipped", "changed=0"]
    # Stage 1 trained on: its copy is replaced, and stage 2 starts again from it.
    _model(stage1, 8, b"v2")
    lines = _lib(f"model_of {stage1} 8 {start}; finetune_or_resume {run} 3 --model {start}; echo changed=$CHANGED")
    assert "training it again" in lines[1]
    assert lines[2] == f"genolong finetune --data data/x --steps 3 --out {run} --overwrite --model {start}" and lines[3] == "changed=1"
    assert "step 8" in (run / "START_MODEL").read_text()


def test_a_run_of_an_older_pipeline_is_not_given_a_start_it_may_not_have_had(tmp_path, run):
    start = tmp_path / "start-model"
    _model(tmp_path / "stage1", 4, b"v1")
    _lib(f"model_of {tmp_path / 'stage1'} 4 {start}")
    run.mkdir()
    (run / "options.json").write_text("{}")
    _checkpoint(run, 3)
    assert _lib(f"finetune_or_resume {run} 3 --model {start}") == [f"{run}: finished (3 steps), skipped"]
    assert not (run / "START_MODEL").exists()
