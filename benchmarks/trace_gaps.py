"""Where the GPU waits during a profiled step: the idle gaps of the compute stream and their causes.

`profile_step.py` sums kernel durations over every stream, which counts the offload copies (on
their own streams, overlapped) as busy time; a step can look 94% busy while its compute stream
idles for a tenth of it. This reads the profiler's trace events (kineto's chrome trace: GPU
"kernel" / "gpu_memcpy" / "gpu_memset" events with args.stream and args.correlation, host
"cuda_runtime" / "cuda_driver" calls with the same correlation ids) and says, for each gap
between two kernels on the compute stream (the stream with the most kernel time):

- "host sync: <call>": the host sat in a blocking call (cudaStreamSynchronize, a synchronous
  memcpy, cudaFree, ...) when the stream ran dry, and launched the next kernel only after it;
- "host-bound": the next kernel was launched after the stream ran dry and no blocking call
  explains it (Python, launch overhead, host work between kernels);
- "stream wait": the next kernel had been launched before the gap, so the GPU held it back for a
  dependency on another stream (an event wait on a copy, say); `other streams busy` says how
  much of those gaps another stream was working.

Pure functions over the event list, so the CPU tests feed them synthetic traces.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cuda_runtime", "cuda_driver")
# Host calls that block until the device (or a stream) has finished the work before them.
BLOCKING = ("Synchronize", "cudaMemcpy", "cuMemcpy", "cudaFree", "cuMemFree", "cudaMalloc", "cuMemAlloc",
            "cudaHostAlloc", "cudaHostRegister", "cudaHostUnregister", "cudaFreeHost", "cuMemHostAlloc", "cuMemHostRegister")
# Microseconds from a launch call's return to its kernel's start on an idle stream (H100/H200: a few).
LAUNCH_LATENCY_US = 3.0
# Size classes of the gaps, in microseconds (upper bounds).
BUCKETS_US = (10.0, 100.0, 1000.0, 10000.0, float("inf"))


def _stream(ev: dict):
    args = ev.get("args") or {}
    return (ev.get("pid"), args.get("stream", ev.get("tid")))


def _blocking(name: str) -> bool:
    # Asynchronous memcpys do not block on pinned memory; a sync memcpy is named without "Async".
    return any(b in name for b in BLOCKING) and ("Async" not in name or "Synchronize" in name)


def _merged(intervals: list[tuple[float, float, str]]) -> list[list]:
    """[start, end, first name, last name] runs of overlapping intervals, in time order."""
    out: list[list] = []
    for start, end, name in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1][1], out[-1][3] = end, name
        else:
            out.append([start, end, name, name])
    return out


def _overlap(runs: list[list], starts: list[float], lo: float, hi: float) -> float:
    """Microseconds of [lo, hi] covered by the merged `runs` (their starts in `starts`)."""
    covered, i = 0.0, max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(runs) and runs[i][0] < hi:
        covered += max(0.0, min(hi, runs[i][1]) - max(lo, runs[i][0]))
        i += 1
    return covered


def analyse(events: list[dict], *, min_gap_us: float = 5.0, top: int = 25) -> dict:
    """The compute stream's busy time, its gaps by size and cause, and the largest gaps (module docstring)."""
    gpu = [e for e in events if e.get("ph", "X") == "X" and e.get("cat") in GPU_CATS and "dur" in e]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    kernel_us: dict = defaultdict(float)
    per_stream: dict = defaultdict(list)
    for e in gpu:
        per_stream[_stream(e)].append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?")))
        if e["cat"] == "kernel":
            kernel_us[_stream(e)] += float(e["dur"])
    # The compute stream: the most kernel time, NCCL's kernels left out (they spin while waiting for
    # peers, so a communication stream can hold more kernel time than the one computing).
    compute_us: dict = defaultdict(float)
    for e in gpu:
        if e["cat"] == "kernel" and "nccl" not in e.get("name", "").lower():
            compute_us[_stream(e)] += float(e["dur"])
    compute = max(compute_us or kernel_us or per_stream, key=lambda s: compute_us.get(s, kernel_us.get(s, 0.0)))
    runs = {s: _merged(iv) for s, iv in per_stream.items()}
    span = (min(r[0][0] for r in runs.values()), max(r[-1][1] for r in runs.values()))
    others = _merged([(r[0], r[1], "") for s, rs in runs.items() if s != compute for r in rs])
    other_starts = [r[0] for r in others]

    host = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", "?"),
                   (e.get("args") or {}).get("correlation"), e.get("tid"))
                  for e in events if e.get("cat") in HOST_CATS and "ts" in e)
    # A launch call's end and thread: a kernel queued only just before the stream ran dry still
    # starts a few microseconds later (launch latency), which is host-bound, not a wait.
    launch_at = {c: (end, tid) for _, end, _, c, tid in host if c is not None}
    blocking_ends = sorted((end, ts, name, tid) for ts, end, name, _, tid in host if _blocking(name))
    first_of_run = {}
    for e in gpu:
        if _stream(e) == compute:
            first_of_run.setdefault(float(e["ts"]), (e.get("args") or {}).get("correlation"))

    compute_runs = runs[compute]
    gaps, by_cause = [], defaultdict(lambda: [0, 0.0, 0.0])
    buckets = [[0, 0.0] for _ in BUCKETS_US]
    for prev, nxt in zip(compute_runs, compute_runs[1:]):
        lo, hi = prev[1], nxt[0]
        gap = hi - lo
        if gap < min_gap_us:
            continue
        launch_end, launch_tid = launch_at.get(first_of_run.get(nxt[0]), (None, None))
        if not host:
            cause = "unknown (no host runtime calls in the trace)"
        elif launch_end is not None and launch_end + LAUNCH_LATENCY_US < lo:
            cause = "stream wait"
        else:
            # The blocking call the launching thread was in when the stream ran dry, or that ended before the launch.
            until = launch_end if launch_end is not None else hi
            i = bisect.bisect_left(blocking_ends, (lo - 0.5 * gap,))
            names = [name for end, ts, name, tid in blocking_ends[i:]
                     if ts <= lo + 0.5 * gap and end <= until + 1.0 and (launch_tid is None or tid == launch_tid)]
            cause = f"host sync: {names[0]}" if names else "host-bound"
        busy_elsewhere = _overlap(others, other_starts, lo, hi)
        entry = by_cause[cause]
        entry[0] += 1
        entry[1] += gap
        entry[2] += busy_elsewhere
        for b, upper in enumerate(BUCKETS_US):
            if gap <= upper:
                buckets[b][0] += 1
                buckets[b][1] += gap
                break
        gaps.append((gap, lo, cause, prev[3], nxt[2]))
    busy = sum(r[1] - r[0] for r in compute_runs)
    window = compute_runs[-1][1] - compute_runs[0][0]
    labels = [f"<= {u:g} us" if u != float("inf") else f"> {BUCKETS_US[-2]:g} us" for u in BUCKETS_US]
    return {
        "compute_stream": list(compute),
        "trace_span_ms": (span[1] - span[0]) / 1e3,
        "compute_window_ms": window / 1e3,
        "compute_busy_ms": busy / 1e3,
        "compute_idle_ms": (window - busy) / 1e3,
        "streams_busy_ms": {f"{s[0]}:{s[1]}": sum(r[1] - r[0] for r in rs) / 1e3 for s, rs in sorted(runs.items(), key=lambda kv: str(kv[0]))},
        "gaps_by_size": {label: {"count": c, "ms": us / 1e3} for label, (c, us) in zip(labels, buckets)},
        "gaps_by_cause": {cause: {"count": c, "ms": us / 1e3, "other_streams_busy_ms": o / 1e3}
                          for cause, (c, us, o) in sorted(by_cause.items(), key=lambda kv: -kv[1][1])},
        "largest_gaps": [{"ms": g / 1e3, "at_ms": (lo - span[0]) / 1e3, "cause": cause, "after": before[:120], "before": after[:120]}
                         for g, lo, cause, before, after in sorted(gaps, reverse=True)[:top]],
    }


def report(summary: dict) -> str:
    """A few lines for the log."""
    if "error" in summary:
        return summary["error"]
    lines = [f"compute stream {summary['compute_stream']}: busy {summary['compute_busy_ms']:.0f} ms of a "
             f"{summary['compute_window_ms']:.0f} ms window, idle {summary['compute_idle_ms']:.0f} ms"]
    lines += [f"  gaps {label}: {v['count']} ({v['ms']:.1f} ms)" for label, v in summary["gaps_by_size"].items() if v["count"]]
    lines += [f"  {cause}: {v['count']} gaps, {v['ms']:.1f} ms (another stream busy {v['other_streams_busy_ms']:.1f} ms of it)"
              for cause, v in summary["gaps_by_cause"].items()]
    lines += [f"  {g['ms']:7.2f} ms at {g['at_ms']:8.1f} ms  {g['cause']:<32} after {g['after'][:60]} / before {g['before'][:60]}"
              for g in summary["largest_gaps"][:12]]
    return "\n".join(lines)
