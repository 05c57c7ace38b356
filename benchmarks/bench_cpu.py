"""CPU speed of the `tiny` preset on the reference ops: forward + backward, and training throughput.

    python benchmarks/bench_cpu.py                                  # 2k, 4k, 8k; prepares the bundled genome
    python benchmarks/bench_cpu.py --lengths 2k --data data/bundled --out runs/bench_cpu

1. Correctness first: the KDA reference against a token-by-token float64 recurrence (256 tokens).
2. Forward + backward of `tiny` (fp32, reference ops, the LM loss over all tokens) at each
   length: one warm-up, then `--repeats` timed runs; median wall time and median process CPU time.
3. `genolong.train.loop.train` as `genolong finetune --preset tiny --device cpu --no-recompute
   --no-offload` runs it, `--train-steps` steps per length on the bundled genome: the median
   step time and tokens/s over the steps after the first (the first includes warm-up).

Like CPU training (genolong/train/host_allocator.py), the benchmark keeps freed host memory in
the process; `--default-malloc` measures with glibc's defaults instead.

Wall time is what a user waits; process CPU time (all threads of this process) is what the work
costs, and stays meaningful when other processes share the cores: the table gives both, the
thread count and the 1-minute load average before each measurement. With `--out`, the table, a
JSON of every timing and the training runs' metrics are kept there. `--budget-s` skips the
measurements that would start after that many seconds (reported as skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from genolong.units import format_length, parse_length


def check_kda_reference() -> float:
    """Max abs difference of kda_reference from the plain recurrence; raises if it is wrong."""
    from genolong.model.kda import kda_reference

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 256, 2, 32, generator=gen) for _ in range(3))
    g = -5 * torch.rand(1, 256, 2, 32, generator=gen)
    beta = torch.rand(1, 256, 2, generator=gen)
    qd = q.double() / torch.sqrt((q.double() ** 2).sum(-1, keepdim=True) + 1e-6) * 32**-0.5
    kd = k.double() / torch.sqrt((k.double() ** 2).sum(-1, keepdim=True) + 1e-6)
    state = torch.zeros(1, 2, 32, 32, dtype=torch.float64)
    expected = []
    for t in range(256):
        state = state * g[:, t].double().exp().unsqueeze(-1)
        fix = beta[:, t, :, None].double() * (v[:, t].double() - torch.einsum("bhkv,bhk->bhv", state, kd[:, t]))
        state = state + kd[:, t].unsqueeze(-1) * fix.unsqueeze(-2)
        expected.append(torch.einsum("bhkv,bhk->bhv", state, qd[:, t]))
    err = (kda_reference(q, k, v, g, beta).double() - torch.stack(expected, 1)).abs().max().item()
    if err > 2e-5:
        raise SystemExit(f"kda_reference differs from the recurrence by {err:.3g}: not timing a wrong op")
    return err


def time_forward_backward(seq: int, repeats: int) -> dict:
    from genolong.model import GenoLongForCausalLM, get_preset

    torch.manual_seed(0)
    model = GenoLongForCausalLM(get_preset("tiny"))
    ids = torch.randint(0, 5, (1, seq + 1))

    def step() -> None:
        logits = model(ids[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, 1:]).backward()
        model.zero_grad(set_to_none=True)

    step()
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return {"wall_s": walls, "cpu_s": cpus, "wall_median_s": statistics.median(walls), "cpu_median_s": statistics.median(cpus)}


def time_training(seq: int, steps: int, data: str, out: Path) -> dict:
    """Runs of 1 and of `steps` steps: their CPU-time difference is the cost of the later steps
    alone (set-up, first step and final checkpoint cancel out)."""
    from genolong.train.loop import train
    from genolong.train.options import MemoryOptions, TrainOptions

    def run(n: int, where: Path) -> tuple[list[dict], float]:
        options = TrainOptions(
            data=data,
            out=str(where),
            seq_len=seq,
            preset="tiny",
            steps=n,
            warmup=1,
            device="cpu",
            progress=False,
            tensorboard=False,
            memory=MemoryOptions(recompute=False, offload=False),
        )
        c = time.process_time()
        records = train(options)
        return records, time.process_time() - c

    _, cpu_one = run(1, out / "one-step")
    records, cpu_all = run(steps, out / f"{steps}-steps")
    later = records[1:]
    return {
        "steps": len(records),
        "step_time_median_s": statistics.median(r["step_time_s"] for r in later),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in later),
        "cpu_s_per_step": (cpu_all - cpu_one) / (steps - 1),
        "losses": [r["loss"] for r in records],
    }


def prepare_bundled(where: Path) -> str:
    from genolong import data

    data.prepare(
        data.bundled_genome_path(), where, train=data.BUNDLED_TRAIN, holdout=data.BUNDLED_HOLDOUT, progress=False, log=lambda m: None
    )
    return str(where)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2k,4k,8k")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=6, help="at least 2; 0 skips the training measurement")
    p.add_argument("--data", default=None, help="a prepared genome (default: prepare the bundled one into a temp dir)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--budget-s", type=float, default=600.0)
    p.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's malloc thresholds at their defaults (training on the CPU raises them: genolong/train/host_allocator.py)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.train_steps == 1:
        p.error("--train-steps must be 0 or at least 2 (the first step is warm-up)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.default_malloc:
        import genolong.train.loop

        # train() runs in this process and would raise the thresholds: not here.
        genolong.train.loop.keep_freed_host_memory = lambda: False
    else:
        from genolong.train.host_allocator import keep_freed_host_memory

        keep_freed_host_memory()
    start = time.perf_counter()
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_cpu_"))
    machine = {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "malloc": "glibc defaults" if args.default_malloc else "genolong.train.host_allocator",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    print(f"machine: {machine}", flush=True)
    result = {"machine": machine, "kda_check_max_abs_err": check_kda_reference(), "forward_backward": {}, "train": {}}
    print(f"kda_reference vs recurrence: max abs err {result['kda_check_max_abs_err']:.2e}", flush=True)

    rows = []
    for seq in lengths:
        name = format_length(seq)
        if time.perf_counter() - start > args.budget_s:
            rows.append((name, "fwd+bwd", "skipped (budget)", "", "", ""))
            continue
        load = os.getloadavg()[0]
        fb = time_forward_backward(seq, args.repeats) | {"load_1min": load}
        result["forward_backward"][name] = fb
        rows.append((name, "fwd+bwd", f"{fb['wall_median_s']:.3f}", f"{fb['cpu_median_s']:.3f}", f"{seq / fb['wall_median_s']:,.0f}", f"{load:.1f}"))
        print(rows[-1], flush=True)

    if args.train_steps:
        data = args.data or prepare_bundled(work / "bundled")
        for seq in lengths:
            name = format_length(seq)
            if time.perf_counter() - start > args.budget_s:
                rows.append((name, "train step", "skipped (budget)", "", "", ""))
                continue
            load = os.getloadavg()[0]
            run = (args.out or work) / f"train-{name}"
            tr = time_training(seq, args.train_steps, data, run) | {"load_1min": load}
            result["train"][name] = tr
            rows.append(
                (name, "train step", f"{tr['step_time_median_s']:.3f}", f"{tr['cpu_s_per_step']:.3f}", f"{tr['tokens_per_s_median']:,.0f}", f"{load:.1f}")
            )
            print(rows[-1], flush=True)

    header = ("tokens", "what", "wall s (median)", "CPU s", "tokens/s (wall)", "load 1-min")
    lines = ["| " + " | ".join(r) + " |" for r in [header, tuple("---" for _ in header), *rows]]
    table = "\n".join(lines)
    print(f"\ntiny, fp32, reference ops, {machine['torch_threads']} thread(s), {machine['cpus']} CPUs:\n{table}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_cpu.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        (args.out / "bench_cpu.md").write_text(table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
