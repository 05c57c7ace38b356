"""How this process's `genolong` was typed, so that every command genolong prints works as printed.

scripts/install.sh puts the command at `.venv/bin/genolong` without touching the shell's PATH, so a
message saying "continue with `genolong finetune ...`" would fail with "command not found" in a new
shell. Messages name the command the way it was started instead: plain `genolong` when that name
on PATH is this very program, else its path (relative to the working directory when under it), or
`PYTHON -m genolong` for a module run (torchrun, `python -m genolong`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys


def _short(path: str) -> str:
    full = os.path.abspath(path)
    rel = os.path.relpath(full, os.getcwd())
    if rel.startswith(".."):
        return shlex.quote(full)
    return shlex.quote(rel if os.sep in rel else os.path.join(".", rel))


def command() -> str:
    """The words that start genolong again from this working directory ("genolong" in library use)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "genolong":
        found = shutil.which("genolong")
        if found and os.path.realpath(found) == os.path.realpath(argv0):
            return "genolong"
        return _short(argv0)
    if os.path.basename(argv0) == "__main__.py" and os.path.basename(os.path.dirname(argv0)) == "genolong":
        return f"{_short(sys.executable)} -m genolong"
    return "genolong"
