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
    assert _stage(tmp_path, run)[-1] == f"genolong finetune --resume {run} --steps 4"
    _checkpoint(run, 4)
    assert _stage(tmp_path, run) == [f"{run}: finished (4 steps), skipped"]
    # A longer run asked for later continues the finished one.
    assert _stage(tmp_path, run, steps=6)[-1] == f"genolong finetune --resume {run} --steps 6"
