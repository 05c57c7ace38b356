"""Launching a multi-process run the usual ways, on the CPU: `torchrun ... -m genolong finetune
--parallel dp=2 --device cpu` end to end, and `--parallel cp=2` with the one-process losses; a rank killed with SIGKILL mid-run ends the whole run
with the reason and leaves only complete checkpoints (the run resumes from the last one); Ray with
one actor per rank, where the first actor to fail stops the other and its error comes back as one line."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from genolong import checkpoint_dir
from genolong.errors import GenolongError
from genolong.train import checkpoint as ckpt_io
from genolong.train.metrics import read_jsonl
from tests.train._helpers import prepared_genome

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_genome(tmp_path_factory.mktemp("genome"))


def _torchrun(data, out, *extra, steps=2, parallel="dp=2", seq=64, batch=2, launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")):
    cmd = [
        sys.executable, *launcher, "-m", "genolong", "finetune",
        *(("--parallel", parallel) if parallel else ()), "--device", "cpu", "--data", str(data), "--out", str(out), "--preset", "tiny",
        "--seq", str(seq), "--batch", str(batch), "--steps", str(steps), "--warmup", "1", "--no-progress", "--no-offload", *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_torchrun_dp2_finetune_runs_end_to_end(data, tmp_path):
    proc = _torchrun(data, tmp_path / "run")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("step 2/2: loss") == 1  # rank 0 reports, once
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    ckpt = ckpt_io.latest(tmp_path / "run")
    assert ckpt.name == "step_00000002" and (ckpt / "dcp").is_dir()
    assert json.loads((ckpt / "trainer_state.json").read_text())["layout"] == "dp=2,cp=1,tp=1,ep=1"
    assert json.loads((tmp_path / "run" / "options.json").read_text())["parallel"] == "dp=2"


def test_torchrun_cp2_finetune_has_the_one_process_losses(data, tmp_path):
    """The issue's headline command: one sequence split over two processes (gloo, fp32) trains what
    one process trains, step for step, and counts its tokens once."""
    split = _torchrun(data, tmp_path / "cp2", steps=3, parallel="cp=2", seq=128, batch=1)
    whole = _torchrun(data, tmp_path / "one", steps=3, parallel=None, seq=128, batch=1, launcher=())
    (out, err), (_, whole_err) = split.communicate(timeout=300), whole.communicate(timeout=300)
    assert split.returncode == 0, err[-3000:]
    assert whole.returncode == 0, whole_err[-3000:]
    assert out.count("step 3/3: loss") == 1
    cp2, one = read_jsonl(tmp_path / "cp2" / "metrics.jsonl"), read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [r["step"] for r in cp2] == [1, 2, 3]
    assert [r["tokens"] for r in cp2] == [r["tokens"] for r in one] == [128] * 3
    assert [r["valid_tokens"] for r in cp2] == [r["valid_tokens"] for r in one]
    for a, b in zip(cp2, one, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=2e-5), (cp2, one)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (cp2, one)
    assert len({r["loss"] for r in one}) == 3  # the updates move the loss: a wrong gradient would show
    assert json.loads((ckpt_io.latest(tmp_path / "cp2") / "trainer_state.json").read_text())["layout"] == "dp=1,cp=2,tp=1,ep=1"


def _rank_pid(parent_pid: int, rank: str) -> int | None:
    import psutil

    for child in psutil.Process(parent_pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == rank and "genolong" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


def test_a_rank_killed_mid_run_ends_the_run_and_leaves_only_complete_checkpoints(data, tmp_path):
    from genolong.train.loop import load_run_options, train

    run = tmp_path / "run"
    proc = _torchrun(data, run, "--save-every", "1", steps=500)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            done = len(read_jsonl(run / "metrics.jsonl")) if (run / "metrics.jsonl").is_file() else 0
            if done >= 3:
                break
            time.sleep(0.2)
        victim = _rank_pid(proc.pid, "1")
        assert proc.poll() is None and victim is not None, "the run should be training"
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert time.monotonic() - started < 120
    assert "SIGKILL" in err or "Signal 9" in err, err[-3000:]
    # Every step directory is complete (a save in flight left only its temporary directory) ...
    steps = sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert steps and all(checkpoint_dir.is_complete(p) for p in steps), [p.name for p in steps]
    # ... and the run continues from the last one, here in one process.
    last = int(steps[-1].name.removeprefix("step_"))
    more = train(load_run_options(run, progress=False, stop_after=1, parallel=None))
    assert [r["step"] for r in more] == [last + 1]


def _ray():
    return pytest.importorskip("ray")


class _Rank1Fails:
    """A rank actor whose rank 1 fails before joining the process group: rank 0 then waits in the
    rendezvous until the launcher stops it."""

    def run(self, options_dict, env):
        from genolong.train.launch_ray import RankActor

        if env.get("RANK") == "1":
            return "error", "the data disk went away"
        return RankActor.run(self, options_dict, env)


@pytest.mark.slow  # a local Ray instance and two actor processes: ~40 s on the shared 2-core machine
def test_ray_runs_one_actor_per_rank_and_the_first_failure_stops_the_run(data, tmp_path):
    ray = _ray()
    from genolong.train.launch import launch
    from genolong.train.launch_ray import RankActor, launch_ray
    from genolong.train.options import MemoryOptions
    from tests.train._helpers import tiny_options

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        options = tiny_options(data, tmp_path / "run", steps=2, seq_len=64, batch=2, warmup=1, parallel="dp=2", launcher="ray",
                               memory=MemoryOptions(offload=False))
        records = launch(options)
        assert [r["step"] for r in records] == [1, 2]
        assert (ckpt_io.latest(tmp_path / "run") / "dcp").is_dir()

        failing = type("Rank1Fails", (_Rank1Fails, RankActor), {})
        started = time.monotonic()
        with pytest.raises(GenolongError, match=r"^rank 1: the data disk went away$"):
            launch_ray(tiny_options(data, tmp_path / "fails", steps=2, seq_len=64, batch=2, parallel="dp=2", launcher="ray"), failing)
        assert time.monotonic() - started < 120
        # Both actors and their placement group are released (Ray frees them asynchronously).
        deadline = time.monotonic() + 60
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ray.available_resources().get("CPU", 0) == 2
    finally:
        ray.shutdown()


def test_rank_environments_share_a_node_s_gpus_and_point_at_rank_0():
    from genolong.train.launch_ray import rank_environments

    places = [
        {"ip": "10.0.0.1", "node": "a", "gpus": ["3"], "port": 29500},
        {"ip": "10.0.0.1", "node": "a", "gpus": ["1"], "port": 1},
        {"ip": "10.0.0.2", "node": "b", "gpus": ["0"], "port": 2},
    ]
    envs = rank_environments(places)
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("10.0.0.1", "29500")}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["1,3", "1,3", "0"]
    assert [e["LOCAL_RANK"] for e in envs] == ["1", "0", "0"] and [e["LOCAL_WORLD_SIZE"] for e in envs] == ["2", "2", "1"]
    cpu = rank_environments([{**p, "gpus": []} for p in places])
    assert [e["LOCAL_RANK"] for e in cpu] == ["0", "1", "0"] and all("CUDA_VISIBLE_DEVICES" not in e for e in cpu)
