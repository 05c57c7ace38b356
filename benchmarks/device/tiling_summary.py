"""The rows of docs/memory.md's measured tiling table from what call.sh's `tiling` stage brought back.

    python3 benchmarks/device/tiling_summary.py tiling.tar.gz     (or the unpacked tiling/ directory)

One markdown row per sub-run of benchmarks/device/tiling.sh, from the run's own files: metrics.jsonl
(genolong.train.metrics.StepRecord, one line a step), plan.json (the pre-flight's estimate, bytes),
memory.json and options.json (the tile and the offloaded layers that ran), kernels.json (the
implementation of every hot op), and the stage's info.json (command, exit code, why it stopped) and
samples.tsv (nvidia-smi's memory.used and the host's MemAvailable every 2 s). The step time is the
median of the steps after the first (the first builds and autotunes kernels); the peaks are the
largest of those steps (of step 1 when it is the only one). Standard library only: it runs anywhere.
"""

from __future__ import annotations

import io
import json
import statistics
import sys
import tarfile
from pathlib import Path

GIB = 1024**3
COLUMNS = ("date", "machine", "command", "step s", "peak GPU GiB", "pinned host GiB", "plan GiB", "notes")


def load(path: str | Path) -> dict[str, dict[str, str]]:
    """{sub-run: {file name: text}} from tiling.tar.gz or a directory holding the sub-runs (or tiling/)."""
    path = Path(path)
    runs: dict[str, dict[str, str]] = {}
    if path.is_file():
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if member.isfile() and len(parts) >= 2:
                    runs.setdefault(parts[-2], {})[parts[-1]] = tar.extractfile(member).read().decode("utf-8", "replace")
    else:
        root = path / "tiling" if (path / "tiling").is_dir() else path
        for sub in sorted(p for p in root.iterdir() if p.is_dir()):
            runs[sub.name] = {f.name: f.read_text(encoding="utf-8", errors="replace") for f in sub.iterdir() if f.is_file()}
    runs.pop("tiling", None)  # the archive's top directory holds machine.txt only
    return runs


def _json(files: dict[str, str], name: str):
    text = files.get(name)
    return json.loads(text) if text else None


def _metrics(files: dict[str, str]) -> list[dict]:
    rows = []
    for line in files.get("metrics.jsonl", "").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a line cut off by the stop
    return rows


def _num(value) -> float | None:
    """A metrics value as a float (StepRecord writes non-finite floats as strings)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _machine(info: dict) -> str:
    return (info.get("gpu") or "?").replace("NVIDIA ", "").split(" ")[0]


def _command(info: dict) -> str:
    """The command as a user types it: `genolong ...`, without the stage's --out/--overwrite."""
    words = (info.get("command") or "").split()
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w == "--out":
            skip = True
            continue
        if w == "--overwrite":
            continue
        out.append(w)
    text = " ".join(out).replace("python3 -m genolong", "genolong")
    return f"`{text}`" if text else "-"


def samples(files: dict[str, str]) -> tuple[float | None, float | None]:
    """(largest nvidia-smi memory.used, largest host memory in use) in GiB, from samples.tsv."""
    text = files.get("samples.tsv", "")
    total_kib = None
    gpu, host = [], []
    for line in text.splitlines():
        if line.startswith("#"):
            if "MemTotal" in line:
                total_kib = _num(line.split("MemTotal")[1].split()[0])
            continue
        parts = line.split()
        if len(parts) == 3:
            g, a = _num(parts[1]), _num(parts[2])
            if g is not None:
                gpu.append(g / 1024)
            if a is not None and total_kib is not None:
                host.append((total_kib - a) / 1024**2)
    return (max(gpu) if gpu else None), (max(host) if host else None)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _kernels(files: dict[str, str]) -> str | None:
    audit = _json(files, "kernels.json")
    if audit is None:
        return None
    reference = sorted(op for op, impls in audit.items() if "reference" in impls)
    return "every hot op fused" if not reference else "reference ops: " + ", ".join(reference)


def finetune_row(name: str, files: dict[str, str]) -> list[str]:
    info = _json(files, "info.json") or {}
    steps = _metrics(files)
    times = [_num(r.get("step_time_s")) for r in steps]
    later = [t for t in times[1:] if t is not None]
    measured = steps[1:] if later else steps
    if later:
        span = f"step {len(steps)}" if len(steps) == 2 else f"median of steps 2-{len(steps)}"
        step_s = f"{statistics.median(later):.2f} ({span}; step 1 {times[0]:.1f})"
    elif steps and times[0] is not None:
        step_s = f"step 1 only: {times[0]:.1f} (kernel builds)"
    else:
        step_s = "-"
    peaks = [_num(r.get("peak_gpu_gib")) for r in measured]
    pinned = [_num(r.get("pinned_host_gib")) for r in measured]
    peak = max((p for p in peaks if p is not None), default=None)
    host = max((p for p in pinned if p is not None), default=None)
    plan = _json(files, "plan.json")
    plan_gpu = plan["gpu_total"] / GIB if plan else None
    plan_text = f"GPU {plan_gpu:.1f}, pinned {plan['host_total'] / GIB:.1f}" if plan else "-"
    notes = []
    memory = _json(files, "memory.json")
    options = _json(files, "options.json")
    tile = memory.get("tile_tokens") if memory else (options or {}).get("memory", {}).get("tile_tokens")
    if memory or options:
        notes.append(("tile " + (f"{tile // 1024}k" if tile % 1024 == 0 else str(tile))) if tile else "whole layers")
    if memory:
        notes.append(f"{len(memory.get('offload_layers', []))} layers offloaded" + (f" (plan {plan['offload_layers']})" if plan else ""))
        notes.append(f"keep-sparse {memory.get('keep_sparse')}")
    if peak is not None and plan_gpu:
        notes.append(f"peak/plan {peak / plan_gpu:.2f}")
    kernels = _kernels(files)
    if kernels:
        notes.append(kernels)
    losses = [_num(r.get("loss")) for r in steps]
    if losses:
        notes.append("loss " + " -> ".join(_fmt(x, 4) for x in losses))
    smi, host_used = samples(files)
    if smi is not None:
        notes.append(f"nvidia-smi max {smi:.1f} GiB")
    if host_used is not None:
        notes.append(f"host RAM in use max {host_used:.1f} GiB")
    notes.append(_status(info, len(steps)))
    return [info.get("date", "-"), _machine(info), _command(info), step_s, _fmt(peak), _fmt(host), plan_text, "; ".join(notes)]


def eval_row(name: str, files: dict[str, str]) -> list[str]:
    info = _json(files, "info.json") or {}
    seconds: dict[str, list[float]] = {}
    for line in files.get("partial.jsonl", "").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            break
        if row.get("kind") == "window" and row.get("seconds") is not None:
            seconds.setdefault(row["model"], []).append(float(row["seconds"]))
    notes = []
    if seconds:
        windows = max(len(v) for v in seconds.values())
        per = statistics.mean(s for v in seconds.values() for s in v)
        notes.append(f"{windows} window(s) of 1M scored per model, {per:.1f} s per window and model")
    smi, host_used = samples(files)
    if smi is not None:
        notes.append(f"nvidia-smi max {smi:.1f} GiB")
    if host_used is not None:
        notes.append(f"host RAM in use max {host_used:.1f} GiB")
    notes.append(_status(info, None))
    return [info.get("date", "-"), _machine(info), _command(info), "-", "-", "-", "-", "; ".join(notes)]


def _status(info: dict, steps: int | None) -> str:
    stopped = info.get("stopped", "no info.json: the stage did not reach this sub-run")
    if "rc" not in info:
        return f"not run: {stopped}"
    done = f"{steps} step(s) recorded, " if steps is not None else ""
    return f"{done}{stopped}, exit code {info['rc']}, {info.get('wall_s', '?')} s"


def rows(runs: dict[str, dict[str, str]]) -> list[list[str]]:
    order = ["1m", "512k-tiled", "512k-whole", "128k-tiled", "128k-whole", "eval1m"]
    names = [n for n in order if n in runs] + sorted(n for n in runs if n not in order)
    return [eval_row(n, runs[n]) if n.startswith("eval") else finetune_row(n, runs[n]) for n in names]


def markdown(table: list[list[str]]) -> str:
    out = io.StringIO()
    out.write("| " + " | ".join(COLUMNS) + " |\n")
    out.write("|" + "---|" * len(COLUMNS) + "\n")
    for row in table:
        out.write("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |\n")
    return out.getvalue()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: tiling_summary.py tiling.tar.gz|DIR", file=sys.stderr)
        return 2
    path = Path(argv[0])
    if not path.exists():
        print(f"tiling_summary: {path}: no such file or directory (the `tiling` stage's tiling.tar.gz or its unpacked directory)", file=sys.stderr)
        return 2
    runs = load(path)
    if not runs:
        print(f"tiling_summary: {path} holds no sub-run directories (1m, 512k-tiled, ...)", file=sys.stderr)
        return 2
    sys.stdout.write(markdown(rows(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
