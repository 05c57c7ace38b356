"""The pipeline scripts parse, and every genolong option they pass exists (they are not run here:
the demo takes minutes, the hg38 recipe and the GPU benchmark a GPU)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pipelines").glob("*.sh")))


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_parses(name):
    subprocess.run(["bash", "-n", str(ROOT / name)], check=True)


def _invocations(text):
    """(subcommand, {--options}) for each `$G <subcommand> ...` call, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    for line in joined.splitlines():
        m = re.search(r"\$G (\S+)(.*)", line)
        if m:
            yield m[1], set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m[2]))


def test_every_option_exists():
    helps = {}
    for name in SCRIPTS:
        for command, flags in _invocations((ROOT / name).read_text()):
            if command not in helps:
                out = subprocess.run(
                    [sys.executable, "-m", "genolong", command, "--help"], capture_output=True, text=True,
                    env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"},
                )
                assert out.returncode == 0, out.stderr
                helps[command] = out.stdout
            missing = [f for f in flags if f not in helps[command]]
            assert not missing, f"{name}: genolong {command} has no {missing}"
    assert {"prepare", "finetune", "eval-positional"} <= set(helps)
