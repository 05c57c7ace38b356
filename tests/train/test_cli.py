"""`genolong finetune` on the command line: a run, its resume, and one clear line for bad input."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from genolong.cli import app
from genolong.errors import GenolongError
from genolong.train.resume_flags import changeable_flags
from genolong.train.metrics import read_jsonl
from genolong.train.options import TrainOptions

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--preset", "tiny", "--seq", "64", "--device", "cpu", "--no-progress", "--warmup", "1"]


def _run(*args):
    return CliRunner().invoke(app, ["finetune", *map(str, args)])


def test_finetune_then_resume(data, tmp_path):
    out = tmp_path / "run"
    first = _run("--data", data, "--out", out, "--steps", 2, "--stop-after", 1, *TINY)
    assert first.exit_code == 0, first.output
    assert "step 1/2" in first.output
    second = _run("--resume", out, "--no-progress")
    assert second.exit_code == 0, second.output
    assert [line["step"] for line in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_memory_flags_reach_the_options(data, tmp_path):
    out = tmp_path / "run"
    result = _run(
        "--data", data, "--out", out, "--steps", 1, *TINY, "--no-recompute", "--no-moe-chunking", "--loss-chunk", "32"
    )
    assert result.exit_code == 0, result.output
    options = TrainOptions.from_dict(json.loads((out / "options.json").read_text()))
    m = options.memory
    assert (m.recompute, m.offload, m.moe_chunking, m.chunked_loss, m.loss_chunk_tokens) == (False, False, False, True, 32)
    kept = _run("--data", data, "--out", tmp_path / "k", "--steps", 1, *TINY, "--no-offload", "--keep-sparse", "device")
    assert kept.exit_code == 0, kept.output
    k = TrainOptions.from_dict(json.loads((tmp_path / "k" / "options.json").read_text())).memory
    assert (k.keep_sparse, k.kept_where()) == ("device", "device")
    moe = _run("--data", data, "--out", tmp_path / "m", "--steps", 1, *TINY, "--keep-moe", "--moe-chunk", "32")
    assert moe.exit_code == 0, moe.output
    mo = TrainOptions.from_dict(json.loads((tmp_path / "m" / "options.json").read_text())).memory
    assert (mo.keep_moe, mo.keeps_moe(), mo.moe_chunk_tokens) == (True, True, 32)
    base = _run("--data", data, "--out", tmp_path / "b", "--steps", 1, *TINY, "--baseline")
    assert base.exit_code == 0, base.output
    b = TrainOptions.from_dict(json.loads((tmp_path / "b" / "options.json").read_text())).memory
    assert not (b.recompute or b.offload or b.moe_chunking or b.chunked_loss or b.mhc_low_precision or b.offload_pinned)


def test_balance_and_repeat_flags_reach_the_options(data, tmp_path):
    out = tmp_path / "run"
    args = ["--balance-rate", 0, "--aux-loss-coeff", 1e-4, "--repeat-weight", 0.1]
    result = _run("--data", data, "--out", out, "--steps", 1, *TINY, *args)
    assert result.exit_code == 0, result.output
    options = TrainOptions.from_dict(json.loads((out / "options.json").read_text()))
    assert (options.balance_rate, options.aux_loss_coeff, options.repeat_weight) == (0.0, 1e-4, 0.1)
    line = read_jsonl(out / "metrics.jsonl")[0]
    assert line["aux_loss"] > 0 and set(line["expert_load_max"]) == {"3"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "{tmp}/missing", "--out", "{tmp}/r"], "no such directory"),
        (["--data", "{data}", "--out", "{tmp}/r", "--seq", "1M"], "--seq 1M needs windows of 1,048,577 bases"),
        (["--data", "{data}", "--out", "{tmp}/r", "--seq", "12q"], "is not a token count"),
        (["--data", "{data}", "--out", "{tmp}/r", "--seq", "64", "--preset", "glm-9"], "unknown model preset"),
        (["--data", "{data}", "--out", "{tmp}/r", "--seq", "64", "--model", "{tmp}/nockpt"], "does not exist"),
        (["--resume", "{tmp}"], "not a genolong run"),
        (["--out", "{tmp}/r"], "needs --data"),
        (["--data", "{data}", "--out", "{tmp}/r", "--seq", "64", "--repeat-weight", "2"], "--repeat-weight must be in [0, 1]"),
        (["--data", "{data}", "--out", "{tmp}/r", "--seq", "64", "--balance-rate", "-1"], "--balance-rate and --aux-loss-coeff must be >= 0"),
        (["--data", "{data}", "--out", "{tmp}/r", "--seq", "64", "--keep-sparse", "gpu"], "--keep-sparse must be one of auto, host, device, off"),
        (["--data", "{data}", "--out", "{tmp}/r", "--seq", "64", "--keep-moe", "--no-moe-chunking"], "--keep-moe keeps the MoE output"),
        # The fused policy on a CPU: the first op without a kernel stops the run in one line naming the flag.
        (["--data", "{data}", "--out", "{tmp}/r", "--seq", "64", "--steps", "1", "--kernels", "fused", "--preset", "tiny"],
         "would fall back to the PyTorch reference"),
    ],
)
def test_bad_input_is_one_line(data, tmp_path, args, message):
    args = [a.format(tmp=tmp_path, data=data) for a in args]
    result = _run(*args, "--device", "cpu")
    assert isinstance(result.exception, GenolongError), result.output
    assert message in str(result.exception) and "\n" not in str(result.exception)


def test_a_run_started_with_a_relative_data_path_resumes_from_anywhere(data, tmp_path, monkeypatch):
    monkeypatch.chdir(data.parent)
    out = tmp_path / "run"
    first = _run("--data", data.name, "--out", out, "--steps", 2, "--stop-after", 1, *TINY)
    assert first.exit_code == 0, first.output
    assert TrainOptions.from_dict(json.loads((out / "options.json").read_text())).data == str(data.resolve())
    monkeypatch.chdir(tmp_path)
    second = _run("--resume", out, "--no-progress")
    assert second.exit_code == 0, second.output
    assert len(read_jsonl(out / "metrics.jsonl")) == 2


def test_out_must_be_a_new_or_empty_directory_or_a_run(data, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("hi")
    result = _run("--data", data, "--out", afile, "--steps", 1, *TINY)
    assert isinstance(result.exception, GenolongError) and "is a file, not a directory" in str(result.exception)
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    result = _run("--data", data, "--out", other, "--steps", 1, *TINY)
    assert isinstance(result.exception, GenolongError) and "holds other files and no genolong run" in str(result.exception)
    assert (other / "metrics.jsonl").read_text() == '{"step": 1}\n' and sorted(p.name for p in other.iterdir()) == ["metrics.jsonl"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run("--data", data, "--out", empty, "--steps", 1, *TINY).exit_code == 0


def test_an_input_found_bad_after_the_run_directory_was_made_leaves_none(data, tmp_path):
    # --kernels fused on a CPU fails at the first op without a kernel, after options.json was written:
    # the directory this call made goes, so the corrected command runs without --overwrite.
    out = tmp_path / "r"
    bad = _run("--data", data, "--out", out, "--steps", 1, *TINY, "--kernels", "fused")
    assert isinstance(bad.exception, GenolongError) and "--kernels auto" in str(bad.exception)
    assert not out.exists()
    assert _run("--data", data, "--out", out, "--steps", 1, *TINY, "--kernels", "auto").exit_code == 0


@pytest.mark.parametrize("flag,value", [("--lr", "nan"), ("--grad-clip", "nan"), ("--lr", "inf"), ("--grad-clip", "-1")])
def test_non_finite_or_negative_rates_are_refused(data, tmp_path, flag, value):
    result = _run("--data", data, "--out", tmp_path / "r", "--steps", 1, *TINY, flag, value)
    assert isinstance(result.exception, GenolongError) and flag in str(result.exception), result.output


def test_a_warmup_that_leaves_no_decay_is_pointed_out(data, tmp_path, capfd):
    result = _run("--data", data, "--out", tmp_path / "r", "--steps", 2, *TINY[:-2], "--warmup", 10)
    assert result.exit_code == 0, result.output
    assert "--warmup 10 with --steps 2: the run ends inside the warmup, below --lr; give --warmup 0" in capfd.readouterr().err
    lr = TrainOptions.from_dict(json.loads((tmp_path / "r" / "options.json").read_text())).lr
    assert [line["lr"] for line in read_jsonl(tmp_path / "r" / "metrics.jsonl")] == pytest.approx([lr / 10, 2 * lr / 10])


def test_the_console_script_prints_one_line_and_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "genolong", "finetune", "--data", str(tmp_path / "x"), "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("genolong: error: --data")


# ------------------------------------------------------------------------------ --resume + flags


def _stopped_run(data, tmp_path):
    out = tmp_path / "run"
    first = _run("--data", data, "--out", out, "--steps", 3, "--stop-after", 1, *TINY, "--no-recompute", "--lr", "0.002")
    assert first.exit_code == 0, first.output
    return out


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--seq", "128"], "--seq 128 differs from the run's own setting (64)"),
        (["--lr", "0.01"], "--lr 0.01 differs"),
        (["--recompute"], "--recompute differs"),
        (["--preset", "glm53-mini"], "--preset glm53-mini differs"),
        (["--data", "{tmp}"], "--data"),
        (["--baseline"], "--baseline differs"),
        (["--model", "{tmp}"], "--model {tmp} differs from the run's own setting (not set)"),
    ],
)
def test_resume_refuses_a_flag_that_would_change_the_run(data, tmp_path, args, flag, request):
    out = request.getfixturevalue("stopped_run")
    result = _run("--resume", out, *[a.format(tmp=tmp_path) for a in args])
    assert isinstance(result.exception, GenolongError), result.output
    message = str(result.exception)
    assert flag.format(tmp=tmp_path) in message and "\n" not in message and "None" not in message
    assert f"only {changeable_flags()} can change" in message and "--overwrite" in message


@pytest.fixture(scope="module")
def stopped_run(data, tmp_path_factory):
    return _stopped_run(data, tmp_path_factory.mktemp("stopped"))


def test_resume_accepts_flags_equal_to_the_run_and_applies_the_changeable_ones(stopped_run, data):
    from genolong.train.resume_flags import resume_options

    # Same values as the run (spelled differently) are not conflicts.
    values = {"seq": "64", "lr": 0.002, "no_such": None, "data": str(data) + "/", "steps": 5, "keep_last": 1, "device": "cpu",
              "progress": False, "launcher": "local", "stop_after": None, "recompute": False}
    options = resume_options(str(stopped_run), values, {"seq", "lr", "data", "steps", "keep_last", "recompute"})
    assert (options.steps, options.keep_last, options.seq_len, options.progress) == (5, 1, 64, False)
    assert options.resume and not options.overwrite
    with pytest.raises(GenolongError, match="--no-such 3 cannot be combined with --resume"):
        resume_options(str(stopped_run), {**values, "no_such": 3}, {"no_such"})


def test_resume_with_overwrite_is_refused(stopped_run):
    result = _run("--resume", stopped_run, "--overwrite")
    assert "exclude each other" in str(result.exception)


def test_the_old_budget_spelling_still_works_with_a_deprecation_line(data, tmp_path):
    out = tmp_path / "run"
    result = _run("--data", data, "--out", out, "--steps", 1, *TINY, "--host-budget", "3.5")
    assert result.exit_code == 0, result.output
    assert "--host-budget is deprecated; use --host-budget-gib" in result.output
    assert TrainOptions.from_dict(json.loads((out / "options.json").read_text())).memory.host_budget_gib == 3.5
