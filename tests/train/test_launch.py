"""Launchers: a spawned local worker and a Ray actor run the same loop and report back."""

import pytest

from genolong.errors import GenolongError
from genolong.train import launch as launch_mod
from genolong.train.launch import launch
from genolong.train.loop import check_inputs
from genolong.train.metrics import read_jsonl
from tests.train._helpers import tiny_options

pytestmark = pytest.mark.usefixtures("one_thread")


def test_local_worker_process_runs_the_loop(data, tmp_path):
    records = launch(tiny_options(data, tmp_path / "run", steps=2, seq_len=64, launcher="local"))
    assert [r["step"] for r in records] == [1, 2]
    assert [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [r["loss"] for r in records]


def test_bad_input_fails_before_a_worker_starts(data, tmp_path, monkeypatch):
    monkeypatch.setattr(launch_mod, "_launch_local", lambda options: pytest.fail("a worker was started"))
    with pytest.raises(GenolongError, match="no such directory"):
        launch(tiny_options(tmp_path / "missing", tmp_path / "run"))
    with pytest.raises(GenolongError, match="unknown model preset"):
        launch(tiny_options(data, tmp_path / "run", preset="nope"))


def test_worker_errors_come_back_as_one_line(data, tmp_path):
    # A --model directory with a valid config and tokenizer but no weights passes the launcher's
    # checks (they read no weights) and fails inside the worker, when the weights are loaded.
    from tests.train.test_resume import _glm_like_checkpoint

    ckpt = _glm_like_checkpoint(tmp_path)
    (ckpt / "model.safetensors").unlink()
    options = tiny_options(data, tmp_path / "run", steps=1, seq_len=64, preset=None, model_path=str(ckpt))
    check_inputs(options)
    with pytest.raises(GenolongError, match="safetensors") as err:
        launch(options)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_ray_actor_runs_the_loop(data, tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        records = launch(tiny_options(data, tmp_path / "run", steps=2, seq_len=64, launcher="ray"))
        assert [r["step"] for r in records] == [1, 2]
        assert (tmp_path / "run" / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
        # The same run in-process gives the same losses: the actor runs the loop unchanged.
        local = launch(tiny_options(data, tmp_path / "again", steps=2, seq_len=64, launcher="local"))
        assert [r["loss"] for r in records] == [r["loss"] for r in local]
    finally:
        ray.shutdown()
