"""scripts/install.sh says what it is doing while pip works (a minute or two on a fresh machine),
and a failing pip still fails the script (its output goes through a filter)."""

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/bin/sh
# Stands in for .venv/bin/python: pip prints what a real one would, imports succeed.
case "$*" in
  *"pip install -q"*) exit 0;;
  *"pip install"*) echo "Collecting demo-package"; echo "  Downloading demo-package.whl"; echo "Successfully installed demo-package"; exit ${PIP_RC:-0};;
  *) exit 0;;
esac
"""


def _tree(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(FAKE_PYTHON)
    (venv / "python").chmod(0o755)
    return tmp_path


def _install(tree, **env):
    return subprocess.run(["bash", str(tree / "scripts" / "install.sh")], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def test_install_prints_a_line_per_step_and_each_package(tmp_path):
    result = _install(_tree(tmp_path))
    assert result.returncode == 0, result.stderr
    steps = [line for line in result.stdout.splitlines() if line.startswith("install [")]
    assert [s.split(": ", 1)[1][:5] for s in steps] == ["pip", "torch", "genol", "done:"]
    assert "    Collecting demo-package" in result.stdout and "Downloading" not in result.stdout
    assert ".venv/bin/genolong" in steps[-1]


def test_a_failing_pip_fails_the_install(tmp_path):
    result = _install(_tree(tmp_path), PIP_RC="1")
    assert result.returncode != 0
    assert "done" not in result.stdout
