"""The pipeline scripts parse (they are not run here: the demo takes minutes, the hg38 recipe and
the GPU benchmark a GPU); tests/test_readme.py checks every genolong option they pass exists."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pipelines").glob("*.sh")))


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_parses(name):
    subprocess.run(["bash", "-n", str(ROOT / name)], check=True)
