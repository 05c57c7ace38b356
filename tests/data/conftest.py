"""Helpers for the data tests: an independent reference FASTA parser and a CLI runner.

The reference parser is deliberately naive (line by line, per character): it shares no code
with genolong.data, so agreement between the two is evidence, not tautology.
"""

import contextlib
import gzip
import io
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

REFERENCE_IDS = {"A": 0, "C": 1, "G": 2, "T": 3, "N": 4}
ROOT = Path(__file__).resolve().parents[2]


def reference_parse(path) -> dict[str, dict]:
    """{name: {tokens, mask, iupac}} by the textbook reading of FASTA."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    records: dict[str, list[str]] = {}
    descriptions = {}
    name = None
    for line in raw.decode("ascii").splitlines():
        if line.startswith(">"):
            words = line[1:].split(maxsplit=1)
            name = words[0]
            descriptions[name] = words[1].strip() if len(words) > 1 else ""
            records[name] = []
        elif name is not None:
            records[name].append(line.strip())
    out = {}
    for name, lines in records.items():
        seq = "".join(lines)
        out[name] = {
            "tokens": np.array([REFERENCE_IDS.get(c.upper(), 4) for c in seq], dtype=np.uint8),
            "mask": np.array([c.islower() for c in seq], dtype=bool),
            "iupac": Counter(c.upper() for c in seq if c.upper() not in "ACGTN"),
            "description": descriptions[name],
        }
    return out


def run_cli(*args: str, cwd=None, fresh: bool = False) -> subprocess.CompletedProcess:
    """`genolong ARGS` through the console script's own entry point (genolong.cli.main), in this
    process: the same output and exit code as a user gets, without a second of interpreter start-up
    and imports per call. `fresh`: in a new interpreter, `python -m genolong ARGS`, exactly as typed."""
    if fresh or cwd is not None:
        return subprocess.run([sys.executable, "-m", "genolong", *args], capture_output=True, text=True, cwd=cwd, timeout=300)
    from genolong import cli

    out, err = io.StringIO(), io.StringIO()
    argv, sys.argv = sys.argv, ["genolong", *map(str, args)]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(["genolong", *args], code, out.getvalue(), err.getvalue())


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("genolong: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def write_text_fasta(path: Path, records: list[tuple[str, str]], width: int = 60, newline: str = "\n") -> Path:
    """A FASTA from literal sequences (the tests know every base)."""
    parts = []
    for name, seq in records:
        parts.append(f">{name}{newline}")
        parts.extend(seq[i : i + width] + newline for i in range(0, len(seq), width))
    path.write_bytes("".join(parts).encode("ascii"))
    return path


@pytest.fixture
def small_blocks(monkeypatch):
    """Reads in odd 4099-byte blocks so headers and lines straddle block boundaries."""
    import genolong.data.fasta as fasta

    monkeypatch.setattr(fasta, "BLOCK", 4099)
