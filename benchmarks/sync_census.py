"""Where a step synchronises the host with the GPU: every synchronising CUDA call, by call site.

A host sync (`.item()`, `bool(t)`, `.tolist()`, `bincount` sizing its output, a blocking copy, ...)
drains the launch queue: the GPU idles until the host has queued work again, and a step of many
small kernels then runs host-bound for a while. torch reports each one when
`torch.cuda.set_sync_debug_mode("warn")` is on; `census(run)` runs `run()` so and counts the
warnings by the innermost frames of this project's code (genolong/, benchmarks/) or of fla, from
the Python stack at the moment of the warning. Ops that Python code runs inside backward (the
layers' recompute, custom backward functions) warn on autograd's thread with that thread's stack,
which is what we want; the few syncs autograd's C++ raises itself are replayed at the end of
backward and land on the `backward()` call.
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter

MARK = "synchroniz"  # torch's text: "called a synchronizing CUDA operation"
OURS = ("/genolong/", "/benchmarks/", "/fla/")


def site(stack: list[traceback.FrameSummary], depth: int = 3) -> str:
    """The call site of a warning: the innermost `depth` frames of our code, innermost first."""
    stack = [f for f in stack if not f.filename.endswith(("warnings.py", "sync_census.py"))]  # the census itself
    ours = [f for f in stack if any(part in f.filename for part in OURS)]
    frames = (ours or stack[-1:])[-depth:]
    return " < ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))


def _short(path: str) -> str:
    for part in OURS:
        if part in path:
            return part.strip("/") + "/" + path.split(part, 1)[1]
    return path.rsplit("/", 1)[-1]


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
