"""`torchrun ... -m genolong eval-positional --parallel dp=2`: the windows split over two processes give
the one-process outputs exactly; `--parallel cp=2` (each window split over two processes, with the
shorter truncated-control contexts too) gives them up to fp32 rounding; layouts eval cannot run
yet are refused in one line."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from genolong.data import prepare
from genolong.model import GenoLongForCausalLM, get_preset, save_pretrained

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaldp")
    rng = np.random.default_rng(0)
    text = ""
    for name, n in (("chr1", 3000), ("chr22", 2400)):
        seq = "".join(rng.choice(list("ACGTacgt"), n))
        text += f">{name}\n" + "\n".join(seq[i : i + 70] for i in range(0, n, 70)) + "\n"
    (root / "g.fa").write_text(text)
    prepare(root / "g.fa", root / "data", train="chr1", holdout="chr22", progress=False, log=lambda _: None)
    for name, seed in (("base", 0), ("tuned", 1)):
        torch.manual_seed(seed)
        save_pretrained(GenoLongForCausalLM(get_preset("tiny")), root / name)
    return root


def _eval(world, out, *launcher, extra=(), controls="none"):
    cmd = [*launcher, "-m", "genolong", "eval-positional", "--data", str(world / "data"), "--checkpoint", str(world / "tuned"),
           "--baseline", str(world / "base"), "--seq", "256", "--bucket", "128", "--controls", controls, "--bootstrap", "20",
           "--markov-max-order", "2", "--device", "cpu", "--no-progress", "--out", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_eval_dp2_under_torchrun_equals_one_process(world, tmp_path):
    one = _eval(world, tmp_path / "one", sys.executable)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _eval(world, tmp_path / "two", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("wrote ") == 1  # rank 0 writes and says so
    assert (tmp_path / "two" / "positional.csv").read_text() == (tmp_path / "one" / "positional.csv").read_text()
    windows = (tmp_path / "one" / "partial.jsonl").read_text().count('"model"')
    assert windows == (tmp_path / "two" / "partial.jsonl").read_text().count('"model"') == 2 * 9  # 9 windows x 2 models


def _numbers(path):
    """Every number of positional.json, in order (keys and texts must match exactly)."""
    flat = []

    def walk(x, where):
        if isinstance(x, dict):
            for k in sorted(x):
                walk(x[k], f"{where}.{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{where}[{i}]")
        else:
            flat.append((where, x))

    walk(json.loads(path.read_text()), "")
    return flat


@pytest.mark.slow  # two evaluations of 3 windows with their controls, one under torchrun: ~60 s on the shared 2 cores
def test_eval_cp2_under_torchrun_equals_one_process(world, tmp_path):
    extra = ("--control-context", "64", "--max-windows", "3")  # controls of 64 + up to 64 tokens: lengths that need the padding
    one = _eval(world, tmp_path / "one", sys.executable, extra=extra, controls="truncated")
    assert one.returncode == 0, one.stderr[-3000:]
    two = _eval(world, tmp_path / "two", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                extra=("--parallel", "cp=2", *extra), controls="truncated")
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("wrote ") == 1
    ones, twos = _numbers(tmp_path / "one" / "positional.json"), _numbers(tmp_path / "two" / "positional.json")
    assert [k for k, _ in ones] == [k for k, _ in twos]
    compared = 0
    for (key, a), (_, b) in zip(ones, twos, strict=True):
        if key.startswith(".meta"):  # timings and paths
            continue
        if isinstance(a, float) and isinstance(b, float) and not (math.isnan(a) and math.isnan(b)):
            # Bits per base (~2) and their changes: fp32 sums in another order differ by ~5e-6.
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=2e-5), (key, a, b)
            compared += 1
        elif not isinstance(a, float):
            assert a == b, (key, a, b)
    assert compared > 20


def test_eval_refuses_tp_and_a_world_that_does_not_match(world, tmp_path):
    tp = _eval(world, tmp_path / "tp", sys.executable, extra=("--parallel", "tp=2"))
    assert tp.returncode == 2 and "scoring over tp, ep or fsdp ranks is not wired into eval-positional" in tp.stderr
    dp = _eval(world, tmp_path / "dp", sys.executable, extra=("--parallel", "dp=2"))
    assert dp.returncode == 2 and "needs 2 processes but 1 were started" in dp.stderr
