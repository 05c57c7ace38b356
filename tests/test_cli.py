import subprocess
import sys

from genolong import cli


def test_every_command_is_mounted():
    assert cli.MISSING_COMMANDS == []
    names = {c.name for c in cli.app.registered_commands}
    assert names == {name for name, _, _ in cli.COMMANDS}


def test_help_lists_the_pipeline():
    out = subprocess.run([sys.executable, "-m", "genolong", "--help"], capture_output=True, text=True, check=True)
    for name in ("prepare", "finetune", "eval-positional", "plan", "model-info"):
        assert name in out.stdout


def test_user_error_is_one_line_without_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "genolong", "prepare", "--fasta", str(tmp_path / "missing.fa"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("genolong: error:"), out.stderr
    assert "Traceback" not in out.stderr
