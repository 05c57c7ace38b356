"""Run a script of kernel cases in Triton's interpreter, in a fresh process (the interpreter is
switched on by an environment variable read at import), and collect its "RESULT {json}" lines."""

import json
import os
import subprocess
import sys


def run_cases(script: str, cases, extra_env: dict | None = None, timeout: int = 600) -> dict:
    """{case name: result} from `script` run with json.dumps(cases) as its argument; fails with the
    script's output when a case printed no result."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", **(extra_env or {})}
    run = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=timeout)
    results = {r["name"]: r for r in (json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT "))}
    assert len(results) == len(cases), run.stdout[-2000:] + run.stderr[-4000:]
    return results


def run_script(script: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`script` run in Triton's interpreter in a fresh process (its stdout and stderr captured)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
