"""Where a step synchronises the host with the GPU: every synchronising CUDA call, by call site.

A host sync (`.item()`, `bool(t)`, `.tolist()`, `bincount` sizing its output, a blocking copy, ...)
drains the launch queue: the GPU idles until the host has queued work again, and a step of many
small kernels then runs host-bound for a while. torch reports each one when
`torch.cuda.set_sync_debug_mode("warn")` is on; `census(run)` runs `run()` so and counts the
warnings by the innermost frames of this project's code (the genolong package, benchmarks/) or of fla, from
the Python stack at the moment of the warning. Ops that Python code runs inside backward (the
layers' recompute, custom backward functions) warn on autograd's thread with that thread's stack,
which is what we want; the few syncs autograd's C++ raises itself are replayed at the end of
backward and land on the `backward()` call.
"""

from __future__ import annotations

import importlib.util
import traceback
import warnings
from collections import Counter
from pathlib import Path

MARK = "synchroniz"  # torch's text: "called a synchronizing CUDA operation"


def _roots() -> dict[str, str]:
    """{directory: label} of the code whose frames name a call site: the genolong package, this
    benchmarks folder and fla, located by their modules (a checkout named "genolong" must not make
    every frame below it, torch's in a local .venv included, look like ours)."""
    roots = {str(Path(__file__).resolve().parent): "benchmarks"}
    for name in ("genolong", "fla"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots[str(Path(next(iter(spec.submodule_search_locations))).resolve())] = name
    return roots


ROOTS = _roots()


def _ours(path: str) -> str | None:
    """`path` as label/relative path if it lies in one of ROOTS, else None."""
    resolved = str(Path(path).resolve())
    for root, label in ROOTS.items():
        if resolved.startswith(root + "/"):
            return label + "/" + resolved[len(root) + 1:]
    return None


def site(stack: list[traceback.FrameSummary], depth: int = 3) -> str:
    """The call site of a warning: the innermost `depth` frames of our code, innermost first."""
    here = str(Path(__file__).resolve())
    stack = [f for f in stack if not f.filename.endswith("warnings.py") and str(Path(f.filename).resolve()) != here]
    ours = [f for f in stack if _ours(f.filename)]
    frames = (ours or stack[-1:])[-depth:]
    return " < ".join(f"{_ours(f.filename) or Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))


def census(run, *, set_mode=None) -> dict:
    """{"syncs": n, "sites": {site: count}} of the synchronising calls `run()` makes (module docstring)."""
    if set_mode is None:
        import torch

        set_mode = torch.cuda.set_sync_debug_mode
    counts: Counter = Counter()

    def hook(message, category, filename, lineno, file=None, line=None):
        if MARK in str(message):
            counts[site(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook  # (catch_warnings puts the original back)
        set_mode("warn")
        try:
            run()
        finally:
            set_mode("default")
    return {"syncs": sum(counts.values()), "sites": dict(counts.most_common())}


def report(result: dict, top: int = 20) -> str:
    lines = [f"host syncs in the step: {result['syncs']}"]
    lines += [f"  {n:6d}  {where}" for where, n in list(result["sites"].items())[:top]]
    return "\n".join(lines)
