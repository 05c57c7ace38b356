"""The one entry point of genolong's benchmarks: a registry of the maintained ones and a runner that
stamps each run.

    python -m benchmarks.run list                          # the registry: name, device, what it measures
    python -m benchmarks.run train --data /tmp/bundled --lengths 128k
    python -m benchmarks.run --cache $OUT sparse --budget-s 240
    python -m benchmarks.run --nproc 2 context --lengths 512k

A run executes the benchmark's script in its own process (its arguments passed through), with its
output in a fresh folder <cache>/<name>/<UTC time>-<suffix>/ (unless the arguments name --out), then appends
ONE JSON row to <cache>/rows.jsonl: date, host, GPU, git commit (and whether the tree had changes),
a hash of genolong/'s sources (for trees without .git, as on the device), the command, its exit
code and wall time, and the numbers: every JSON / JSON-lines file the script wrote, and the tail of
what it printed. <cache> is .bench_cache/ (git-ignored) unless --cache says otherwise: results are
regenerated, not committed; the current numbers live in docs/performance.md with the command that
measured them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
# A written file larger than this is listed by name only: a row stays readable with one JSON parser.
EMBED_LIMIT = 512 * 1024
OUTPUT_TAIL_LINES = 60
DATASET_MARKERS = ("dataset_dict.json", "dataset_info.json")


@dataclass(frozen=True)
class Benchmark:
    script: str
    device: str  # "gpu", "gpus" (torchrun, --nproc), "cpu"
    what: str
    # How the script's --out is given: "dir" (a folder), a file name (placed in the run folder), or
    # None (the script prints its results).
    out: str | None = "dir"


REGISTRY: dict[str, Benchmark] = {
    # One GPU: the training step.
    "train": Benchmark("bench_train.py", "gpu", "glm53-mini training on real DNA: tok/s, MFU, peak memory beside the plan", "train.json"),
    "ablation": Benchmark("bench_memory_ablation.py", "gpu", "longest length that trains, full memory stack vs each optimization removed", "ablation.jsonl"),
    "profile": Benchmark("profile_step.py", "gpu", "one profiled step: kernel time by category, compute-stream gaps, host syncs, op sites"),
    "compile": Benchmark("bench_compile_step.py", "gpu", "a step eager vs with the compile pass: parity, time, memory"),
    # One GPU: the kernels.
    "kernels": Benchmark("bench_kernels.py", "gpu", "per-layer time and memory of the hot ops (KDA, DSA, MoE, indexer) by length"),
    "sparse": Benchmark("bench_sparse_attention.py", "gpu", "DSA sparse attention fwd+bwd: genolong's Triton kernels vs megatron-core's TileLang and SDPA"),
    "indexer": Benchmark("bench_indexer.py", "gpu", "the DSA indexer: Triton v2 vs v1 vs plain PyTorch, by stage"),
    "indexer_loss": Benchmark("bench_indexer_loss.py", "gpu", "the indexer's KL loss: parity, then time and memory"),
    "mhc": Benchmark("bench_mhc.py", "gpu", "mHC around a layer: eager vs the fused Triton passes"),
    "moe_combine": Benchmark("bench_moe_combine.py", "gpu", "the MoE combine: index_add vs the Triton combine"),
    "swiglu": Benchmark("bench_swiglu.py", "gpu", "the MoE experts' clamped SwiGLU: eager vs fused"),
    "router_topk": Benchmark("bench_router_topk.py", "gpu", "the MoE router's top-k: torch.topk vs the Triton kernel"),
    "real_layers": Benchmark("bench_real_layers.py", "gpu", "single GLM-5.3-Flash layers at the real shapes, and a 64-GPU 1M-token step from them"),
    # Several GPUs (torchrun).
    "context": Benchmark("bench_context.py", "gpus", "context parallelism on glm53-mini layers: parity, time, communication, balance"),
    "tp_ep": Benchmark("bench_tp_ep.py", "gpus", "tp=2 and ep=2 against cp=2: parity, step time and memory per GPU"),
    # CPU.
    "cpu": Benchmark("bench_cpu.py", "cpu", "the tiny preset on the reference ops: fwd+bwd and training throughput"),
    "indexer_subset": Benchmark("bench_indexer_subset.py", "cpu", "the indexer's learning at equal steps with its KL on every query vs a random share of query blocks"),
    "layer_inputs": Benchmark("bench_layer_inputs.py", "cpu", "the loss curve with the saved layer inputs stored in fp8 vs exact, paired by seed"),
    "cpu_plan": Benchmark("cpu_memory_plan.py", "cpu", "the CPU pre-flight plan against the RAM a training step takes"),
    "prepare": Benchmark("bench_prepare.py", "cpu", "`genolong prepare` speed and memory on an hg38-sized FASTA", None),
    "plan_table": Benchmark("plan_parallel_table.py", "cpu", "docs/parallel.md's plan table: glm-5.3-flash at 1M tokens on 16-64 GPUs", None),
}


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_hash() -> str:
    """sha1 over genolong/'s Python sources (path and bytes): names the code where .git is absent."""
    digest = hashlib.sha1()
    for path in sorted((ROOT / "genolong").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def gpu_names() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def machine() -> dict:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return dict(
        host=socket.gethostname(),
        platform=platform.platform(),
        cpus=os.cpu_count(),
        gpus=gpu_names(),
        python=platform.python_version(),
        git_commit=_git("rev-parse", "--short", "HEAD"),
        git_dirty=None if status is None else bool(status),
        source_hash=source_hash(),
    )


def _has_out(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--out" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--out="):
            return arg.split("=", 1)[1]
    return None


def collect(folder: Path) -> dict:
    """Every JSON / JSON-lines file under `folder`, parsed, by relative path; large ones by name only."""
    found: dict = {}
    if not folder.is_dir():
        return found
    # A prepared dataset a benchmark made for itself (Hugging Face's metadata files) and a training run's
    # checkpoints are its inputs and by-products, not its results.
    datasets = {p.parent for name in DATASET_MARKERS for p in folder.rglob(name)}
    for path in sorted(folder.rglob("*")):
        if path.suffix not in (".json", ".jsonl") or not path.is_file():
            continue
        if any(d == path.parent or d in path.parents for d in datasets) or "checkpoints" in path.relative_to(folder).parts:
            continue
        name = str(path.relative_to(folder))
        if path.stat().st_size > EMBED_LIMIT:
            found[name] = f"<{path.stat().st_size} bytes: not embedded>"
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            found[name] = ([json.loads(line) for line in text.splitlines() if line.strip()]
                           if path.suffix == ".jsonl" else json.loads(text))
        except json.JSONDecodeError as why:
            found[name] = f"<unparsable: {why}>"
    return found


def run(name: str, args: list[str], cache: Path, nproc: int | None) -> int:
    bench = REGISTRY[name]
    if bench.device == "gpus" and not nproc:
        sys.exit(f"{name} runs under torchrun: give --nproc N (the GPUs to use) before the name")
    if nproc and bench.device != "gpus":
        sys.exit(f"--nproc is for the torchrun benchmarks ({', '.join(n for n, b in REGISTRY.items() if b.device == 'gpus')}), not {name}")
    started = dt.datetime.now(dt.timezone.utc)
    (cache / name).mkdir(parents=True, exist_ok=True)
    # Two runs started in one second (or at once on several processes) each get their own folder.
    folder = Path(tempfile.mkdtemp(prefix=started.strftime("%Y%m%dT%H%M%SZ-"), dir=cache / name))
    given = _has_out(args)
    if given is None and bench.out is not None:
        args = [*args, "--out", str(folder if bench.out == "dir" else folder / bench.out)]
    script = str(HERE / bench.script)
    launcher = ["torchrun", "--standalone", f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    command = [*launcher, script, *args]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    print(f"benchmarks.run: {shlex.join(command)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    lines: list[str] = []
    with (folder / "output.txt").open("w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            lines.append(line.rstrip("\n"))
            del lines[:-OUTPUT_TAIL_LINES]
        rc = proc.wait()
    wall = time.perf_counter() - t0
    numbers = collect(folder)
    if given is not None:  # the caller's own --out: a folder, or one file the script wrote
        out = Path(given)
        written = collect(out) if out.is_dir() else {k: v for k, v in collect(out.parent).items() if k == out.name}
        numbers.update({str(out / k) if out.is_dir() else given: v for k, v in written.items()})
    row = dict(benchmark=name, date=started.isoformat(timespec="seconds"), **machine(),
               command=shlex.join(["python", "-m", "benchmarks.run", *(["--nproc", str(nproc)] if nproc else []), name, *args]),
               rc=rc, wall_s=round(wall, 1), folder=str(folder), numbers=numbers, output_tail=lines)
    with (cache / "rows.jsonl").open("a", encoding="utf-8") as rows:
        rows.write(json.dumps(row) + "\n")
    print(f"benchmarks.run: {name} rc={rc} in {wall:.0f} s; row appended to {cache / 'rows.jsonl'}", file=sys.stderr)
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                 epilog="Arguments after NAME go to the benchmark; `python -m benchmarks.run NAME --help` shows them.")
    ap.add_argument("--cache", type=Path, default=ROOT / ".bench_cache", help="where rows.jsonl and the run folders go (default: .bench_cache/)")
    ap.add_argument("--nproc", type=int, default=None, help="GPUs for the torchrun benchmarks")
    ap.add_argument("name", help="a benchmark's name, or `list`")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    opts = ap.parse_args(argv)
    if opts.name == "list":
        width = max(map(len, REGISTRY))
        for name, bench in REGISTRY.items():
            print(f"{name:<{width}}  {bench.device:<4}  {bench.what}  (benchmarks/{bench.script})")
        return 0
    if opts.name not in REGISTRY:
        ap.error(f"unknown benchmark {opts.name!r}: one of {', '.join(REGISTRY)} (or `list`)")
    if "--help" in opts.args or "-h" in opts.args:
        return subprocess.call([sys.executable, str(HERE / REGISTRY[opts.name].script), "--help"], cwd=ROOT)
    return run(opts.name, opts.args, opts.cache, opts.nproc)


if __name__ == "__main__":
    sys.exit(main())
