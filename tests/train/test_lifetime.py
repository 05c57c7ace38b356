"""Real processes: `genolong finetune` and its training worker live and die together, and an
interrupted run can always be continued (--resume) or started again (--overwrite)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from genolong import checkpoint_dir
from genolong.lifeline import PARENT_GONE_GRACE_S
from genolong.errors import GenolongError
from genolong.train import checkpoint as ck
from genolong.train import loop
from genolong.train.metrics import read_jsonl
from tests.train._helpers import tiny_options

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker through /proc (Linux)"),
]

ROOT = Path(__file__).resolve().parents[2]


def _finetune(data, run, *args):
    """`genolong finetune` of the tiny model in its own process, long enough to be stopped midway."""
    cmd = [sys.executable, "-m", "genolong", "finetune", "--data", str(data), "--out", str(run), "--preset", "tiny",
           "--seq", "64", "--steps", "100000", "--device", "cpu", "--no-progress", "--warmup", "1", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # As from a terminal: a test run started in the background would hand down an ignored SIGINT.
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=default_sigint)


def _communicate(proc, timeout):
    """stderr of a process that must end by itself; killed (with its worker) if it does not."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        worker = _worker_of(proc.pid)
        proc.kill()
        if worker is not None:
            os.kill(worker, signal.SIGKILL)
        pytest.fail(f"`genolong finetune` did not stop within {timeout} s")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _worker_of(pid):
    """The spawned training worker among `pid`'s children (not multiprocessing's resource tracker)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            return int(entry)
    return None


def _wait_for_steps(proc, run, steps, timeout=240):
    """The worker's pid once the run has logged `steps` steps."""
    deadline = time.monotonic() + timeout
    metrics = run / ck.METRICS_FILE
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if metrics.exists() and len(read_jsonl(metrics)) >= steps:
            worker = _worker_of(proc.pid)
            assert worker is not None
            return worker
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the run did not reach step {steps} in {timeout} s")


def _gone_within(pid, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_the_worker_dies_when_its_parent_is_killed(data, tmp_path):
    run = tmp_path / "run"
    proc = _finetune(data, run)
    worker = _wait_for_steps(proc, run, 1)
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up: only the worker's lifeline can act
    proc.wait()
    # The parent-death signal stops the worker in ~1 s on a quiet machine, 5-8 s with 8 busy
    # processes on 2 cores (and more under CI's load). The deadline stays below the lifeline's
    # hard exit, so a worker that only that exit ends still fails here.
    deadline = 0.75 * PARENT_GONE_GRACE_S
    try:
        assert _gone_within(worker, deadline), f"the training worker outlived its killed parent by {deadline:.0f} s"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_ctrl_c_stops_both_with_130_and_the_run_continues_with_resume(data, tmp_path):
    run = tmp_path / "run"
    proc = _finetune(data, run, "--save-every", 2)
    worker = _wait_for_steps(proc, run, 3)
    os.kill(proc.pid, signal.SIGINT)
    err = _communicate(proc, 120)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("genolong: interrupted; last complete checkpoint: step "), err
    # Started as `PYTHON -m genolong`: the line names it that way (this Python, by a path from the
    # working directory), so it works as printed.
    python, rest = lines[-1].split("continue with `", 1)[1].split(" -m genolong ", 1)
    assert rest == f"finetune --resume {run}`"
    assert Path(python).resolve() == Path(sys.executable).resolve()
    assert not _alive(worker)
    saved = ck.latest(run)
    assert saved is not None and checkpoint_dir.is_complete(saved)
    assert not [p for p in (run / ck.CHECKPOINTS).iterdir() if p.name.startswith(".")]
    at = int(saved.name.removeprefix("step_"))
    more = loop.train(loop.load_run_options(run, stop_after=1, progress=False))
    assert [r["step"] for r in more] == [at + 1]


def test_sigterm_before_the_first_checkpoint_then_overwrite_starts_again(data, tmp_path):
    run = tmp_path / "run"
    proc = _finetune(data, run)  # no --save-every: nothing is saved before the last step
    _wait_for_steps(proc, run, 1)
    os.kill(proc.pid, signal.SIGTERM)  # what a batch scheduler sends
    err = _communicate(proc, 120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("genolong: interrupted; no complete checkpoint yet: start it again with the same command plus --overwrite")
    with pytest.raises(GenolongError, match="stopped before its first complete checkpoint; start it again by adding --overwrite"):
        loop.train(tiny_options(data, run, steps=1, seq_len=64))
    with pytest.raises(GenolongError, match="no complete checkpoint .* plus --overwrite"):
        loop.load_run_options(run)
    records = loop.train(tiny_options(data, run, steps=1, seq_len=64, overwrite=True))
    assert [r["step"] for r in records] == [1]
    assert [r["step"] for r in read_jsonl(run / ck.METRICS_FILE)] == [1]
    assert ck.latest(run).name == "step_00000001"


def test_a_worker_killed_like_the_oom_killer_does_ends_in_one_line(data, tmp_path):
    run = tmp_path / "run"
    proc = _finetune(data, run)
    worker = _wait_for_steps(proc, run, 1)
    os.kill(worker, signal.SIGKILL)
    err = _communicate(proc, 60)
    assert proc.returncode == 2, err
    assert err.count("\n") == 1, err
    assert err.startswith("genolong: error: the training worker was killed by SIGKILL (the kernel's out-of-memory killer")
    assert "no complete checkpoint yet: start it again with the same command plus --overwrite" in err
