"""`torchrun ... -m genolong eval-positional --parallel dp=2`: the windows split over two processes give
the one-process outputs exactly; layouts eval cannot run yet are refused in one line."""

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


def _eval(world, out, *launcher, extra=()):
    cmd = [*launcher, "-m", "genolong", "eval-positional", "--data", str(world / "data"), "--checkpoint", str(world / "tuned"),
           "--baseline", str(world / "base"), "--seq", "256", "--bucket", "128", "--controls", "none", "--bootstrap", "20",
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


def test_eval_refuses_cp_and_a_world_that_does_not_match(world, tmp_path):
    cp = _eval(world, tmp_path / "cp", sys.executable, extra=("--parallel", "cp=2"))
    assert cp.returncode == 2 and "only dp (windows split over processes) is supported yet" in cp.stderr
    dp = _eval(world, tmp_path / "dp", sys.executable, extra=("--parallel", "dp=2"))
    assert dp.returncode == 2 and "needs 2 processes but 1 were started" in dp.stderr
