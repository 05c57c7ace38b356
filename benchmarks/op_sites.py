"""Which lines of genolong launch a step's GPU kernels: a profiled step's kernels grouped by the
Python line they came from, so that the generic PyTorch kernels of a profile (bf16 adds, copies,
concatenations, gathers, fills: ~0.3 s of a 128k glm53-mini step on 2026-12-03) can be
traced to the code that asks for them.

    from op_sites import profile_sites, report
    rows = profile_sites(lambda: bench.step(tokens), Path("runs/sites"))    # one step, CPU + CUDA, with stacks
    print(report(rows))

A kernel's site is found through the trace (Chrome format, as torch.profiler exports it):
- its launch: the `cuda_runtime` event with the kernel's correlation id, on some host thread;
- the operator around the launch on that thread (the innermost `cpu_op`) and the innermost Python
  frames of `frame_filter` (genolong's own files) around it;
- a launch on autograd's thread has no Python frames of its own: the innermost
  `autograd::engine::evaluate_function: <Node>` around it names the backward node, and the node's
  sequence number leads to the forward operator that recorded it and that operator's Python
  frames ("<Node> of <forward site>"). A launch outside any node is the engine's own work
  (gradient accumulation of a tensor used twice): "autograd engine".

Without CUDA (the CPU tests) the operators' own durations stand in for kernels.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

NODE_PREFIX = "autograd::engine::evaluate_function: "
DEFAULT_FILTER = "genolong/"


def _frames(stack: list[dict], frame_filter: str, depth: int) -> str:
    names = [ev["name"] for ev in reversed(stack) if ev.get("cat") == "python_function" and frame_filter in ev["name"]]
    return " < ".join(_short(n) for n in names[:depth])


def _short(frame: str) -> str:
    # "…/genolong/model/mhc.py(120): expand" -> "model/mhc.py:120 expand"
    path, _, func = frame.partition(": ")
    path = path.split(DEFAULT_FILTER, 1)[-1]
    file, _, line = path.rstrip(")").partition("(")
    return f"{file}:{line} {func}".strip()


def _sweep(events: list[dict], points: dict[tuple, list]) -> dict:
    """For each (tid, ts) in `points`: the stack of enclosing host events (outermost first)."""
    by_tid: dict = defaultdict(list)
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in ev:
            by_tid[ev["tid"]].append(ev)
    stacks = {}
    wanted: dict = defaultdict(list)
    for tid, ts in points:
        wanted[tid].append(ts)
    for tid, times in wanted.items():
        intervals = sorted(by_tid.get(tid, []), key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        i = 0
        for ts in sorted(times):
            while i < len(intervals) and intervals[i]["ts"] <= ts:
                ev = intervals[i]
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < ev["ts"]:
                    stack.pop()
                stack.append(ev)
                i += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts:
                stack.pop()
            stacks[(tid, ts)] = [e for e in stack if e["ts"] <= ts <= e["ts"] + e["dur"]]
    return stacks


def sites(events: list[dict], frame_filter: str = DEFAULT_FILTER, depth: int = 2, ops: tuple[str, ...] = ()) -> list[dict]:
    """Rows {kernel, op, site, ms, calls}, by total time; `ops` (operator names) keeps only those."""
    kernels = [ev for ev in events if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in ev]
    if kernels:
        launches = {ev["args"]["correlation"]: ev for ev in events
                    if ev.get("cat") == "cuda_runtime" and "correlation" in ev.get("args", {})}
        timed = [(k["name"], k["dur"], launches.get(k.get("args", {}).get("correlation"))) for k in kernels]
        timed = [(name, dur, (launch["tid"], launch["ts"])) for name, dur, launch in timed if launch is not None]
    else:  # no device: the operators themselves
        timed = [(ev["name"], ev["dur"], (ev["tid"], ev["ts"])) for ev in events
                 if ev.get("cat") == "cpu_op" and "dur" in ev and (not ops or ev["name"] in ops)]
    stacks = _sweep(events, {point: [] for _, _, point in timed})
    # Forward operators by sequence number: where each backward node was recorded.
    forward_site: dict = {}
    seq_points = {(ev["tid"], ev["ts"]): ev for ev in events
                  if ev.get("cat") == "cpu_op" and ev.get("args", {}).get("Sequence number") is not None
                  and not ev["name"].startswith(NODE_PREFIX)}
    seq_stacks = _sweep(events, {p: [] for p in seq_points})
    for point, ev in seq_points.items():
        where = _frames(seq_stacks.get(point, []), frame_filter, depth)
        if where:
            forward_site.setdefault(ev["args"]["Sequence number"], f"{ev['name']} at {where}")
    table: dict = defaultdict(lambda: [0.0, 0])
    for name, dur, point in timed:
        stack = stacks.get(point, [])
        op = next((e["name"] for e in reversed(stack) if e.get("cat") == "cpu_op" and not e["name"].startswith(NODE_PREFIX)), "-")
        if ops and op not in ops:
            continue
        # The innermost of a genolong frame and a backward node decides: a node inside Python frames
        # is backward work under a `.backward()` call (on the CPU the engine runs on the caller's
        # thread); Python frames inside a node are a recompute's forward.
        inner = next((e for e in reversed(stack) if e["name"].startswith(NODE_PREFIX)
                      or (e.get("cat") == "python_function" and frame_filter in e["name"])), None)
        if inner is not None and inner["name"].startswith(NODE_PREFIX):
            seq = inner.get("args", {}).get("Sequence number")
            where = f"{inner['name'][len(NODE_PREFIX):]} of {forward_site.get(seq, 'an unknown forward site')}"
        elif inner is not None:
            where = _frames(stack, frame_filter, depth)
        else:
            where = "autograd engine" if any(e.get("cat") == "cpu_op" for e in stack) else "(no host operator)"
        key = (name, op, where)
        table[key][0] += dur / 1e3
        table[key][1] += 1
    rows = [dict(kernel=k, op=o, site=s, ms=round(ms, 3), calls=n) for (k, o, s), (ms, n) in table.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def profile_sites(step, out: Path, frame_filter: str = DEFAULT_FILTER, ops: tuple[str, ...] = ()) -> list[dict]:
    """Run `step` once under the profiler (host operators with Python stacks, and CUDA when there
    is a GPU), write <out>/sites.json and return its rows."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, with_stack=True) as prof:
        step()
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "sites-trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    trace.unlink()
    rows = sites(events, frame_filter, ops=ops)
    (out / "sites.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def report(rows: list[dict], top: int = 40, kernel_width: int = 60) -> str:
    total = sum(r["ms"] for r in rows) or 1e-9
    lines = [f"{'ms':>9} {'calls':>6} {'%':>6}  {'kernel':<{kernel_width}}  op  <-  site"]
    for r in rows[:top]:
        lines.append(f"{r['ms']:9.1f} {r['calls']:6d} {r['ms'] / total:6.1%}  {r['kernel'][:kernel_width]:<{kernel_width}}  "
                     f"{r['op']}  <-  {r['site']}")
    return "\n".join(lines)
