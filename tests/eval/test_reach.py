"""`genolong reach`: the share of held-out targets a copier could predict only from distant context."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from genolong.cli import app
from genolong.data import prepare
from genolong.errors import GenolongError
from genolong.eval.reach import count_window, summarise

BASES = np.array(list("ACGT"))


def _fasta(path, seq_hold: str, seq_train: str):
    path.write_text(f">train\n{seq_train}\n>hold\n{seq_hold}\n")
    return path


def test_counts_a_far_copy_in_its_bucket_and_not_a_near_one():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, size=4096)
    tokens[3000:3100] = tokens[200:300]  # 2800 back: beyond 1000
    tokens[1500:1550] = tokens[1300:1350]  # 200 back: within 1000
    mask = np.zeros(4096, dtype=bool)
    mask[3000:3100] = True  # soft-masked copy
    row = count_window(tokens, mask, [16], beyond=1000, bucket=1024)
    # Targets 3016..3100 have the 16 bases before them inside the copy (the last one, just past the copy, is
    # where a copier is wrong: the count is a ceiling): bucket 2 (targets 2048-3071) and bucket 3.
    far = row["k16"]["far"]
    assert far[2] == 3071 - 3016 + 1 and far[3] == 3100 - 3072 + 1 and far[0] == far[1] == 0
    assert row["k16"]["far_repeat"][2] == far[2]  # soft-masked, as the copy is
    assert row["k16"]["near"][1] >= 1550 - 1516 + 1  # the near copy's targets count as near, not far
    summary = summarise([row, row], [16])
    share = summary["by_k"]["16"]["far_share"]
    assert share[2] == pytest.approx(far[2] / row["scored"][2])
    assert summary["by_k"]["16"]["far_in_repeats"][2] == 1.0 and summary["scored"][2] == 2 * row["scored"][2]


def test_the_command_reports_and_writes(tmp_path):
    rng = np.random.default_rng(1)
    hold = rng.integers(0, 4, size=9000)
    hold[7000:7200] = hold[500:700]
    fasta = _fasta(tmp_path / "g.fa", "".join(BASES[hold]), "".join(BASES[rng.integers(0, 4, size=5000)]))
    prepare(fasta, tmp_path / "prep", train="train", holdout="hold", progress=False, log=lambda _m: None)
    result = CliRunner().invoke(app, ["reach", "--data", str(tmp_path / "prep"), "--seq", "8k", "--bucket", "2k",
                                      "--beyond", "1k", "--k", "16", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "k=16, last bucket" in result.output
    saved = json.loads((tmp_path / "r" / "reach.json").read_text())
    far = saved["by_k"]["16"]["far_share"]
    # The copy (targets 7016..7199) lies in the bucket 6k-8k; nothing else of random DNA repeats 16-mers.
    assert far[3] == pytest.approx((7200 - 7016 + 1) / saved["scored"][3], rel=0.02)
    assert far[0] == 0


@pytest.mark.parametrize("args, message", [
    (["--k", "5", "--bucket", "2k"], "k-mer lengths must be in 8"),
    (["--k", "x", "--bucket", "2k"], "comma-separated whole numbers"),
    (["--bucket", "16k"], "longer than the window"),
    (["--beyond", "8k", "--bucket", "2k"], "lower it"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    rng = np.random.default_rng(2)
    fasta = _fasta(tmp_path / "g.fa", "".join(BASES[rng.integers(0, 4, size=9000)]), "".join(BASES[rng.integers(0, 4, size=3000)]))
    prepare(fasta, tmp_path / "prep", train="train", holdout="hold", progress=False, log=lambda _m: None)
    result = CliRunner().invoke(app, ["reach", "--data", str(tmp_path / "prep"), "--seq", "8k", *args])
    assert isinstance(result.exception, GenolongError) and message in str(result.exception), result.output
