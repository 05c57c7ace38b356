""".ci/run runs the README's test command word for word and passes pytest's exit code on."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_LINE = "    bash scripts/install.sh && .venv/bin/python -m pytest -q -n 2 --dist worksteal tests"


def _tree(tmp_path, readme):
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "install.sh").write_text("echo installed\n")
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    # Stands in for pytest: records its arguments and exits with the code the test asks for.
    (venv / "python").write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\nexit ${FAKE_RC:-0}\n')
    (venv / "python").chmod(0o755)
    return tmp_path


def _ci(tree, rc):
    return subprocess.run(["bash", str(tree / ".ci" / "run")], capture_output=True, text=True, env={**os.environ, "FAKE_RC": str(rc)},
                          timeout=60)


def test_the_readme_shows_the_command_ci_reads():
    assert TEST_LINE in (ROOT / "README.md").read_text().splitlines()


@pytest.mark.parametrize("rc", [0, 1, 2, 5])
def test_ci_runs_the_readme_command_and_keeps_its_exit_code(tmp_path, rc):
    tree = _tree(tmp_path, f"# x\n\n{TEST_LINE}\n")
    result = _ci(tree, rc)
    assert result.returncode == rc, result.stderr
    assert "installed" in result.stdout
    assert (tree / ".venv" / "bin" / "args").read_text().split() == ["-m", "pytest", "-q", "-n", "2", "--dist", "worksteal", "tests"]


def test_ci_refuses_a_readme_without_a_test_command(tmp_path):
    result = _ci(_tree(tmp_path, "# no commands\n"), 0)
    assert result.returncode == 2 and "shows no test command" in result.stderr
