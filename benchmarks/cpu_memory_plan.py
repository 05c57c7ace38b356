"""The CPU pre-flight's plan against the RAM a CPU training step really takes (tiny preset).

    python benchmarks/cpu_memory_plan.py [--seqs 4k,8k] [--out /tmp/cpu-memory]

Each (length, recompute) runs two training steps of the tiny preset on the bundled genome in its
own process and reports the peak RSS growth over the process after its imports, next to the
plan's activation items (what genolong.train.plan counts beyond weights, gradients and optimizer
state) and their ratio: the ratio is what `CPU_REFERENCE_FACTOR` must cover. One thread; process
CPU time is printed beside wall time because shared machines distort the latter.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, torch
from genolong.data import bundled_genome_path, prepare
from genolong.model import get_preset
from genolong.train import loop
from genolong.train.options import MemoryOptions, TrainOptions
from genolong.train.plan import estimate_cpu_memory, static_bytes
seq, recompute, root = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
torch.set_num_threads(1)
data = f"{root}/prep"
try:
    prepare(bundled_genome_path(), data, train="NC_008253.1", holdout="NC_001416.1", progress=False, log=lambda m: None)
except Exception:
    pass  # prepared by an earlier child
mem = MemoryOptions(recompute=recompute, offload=False)
opts = TrainOptions(data=data, out=f"{root}/run-{seq}-{int(recompute)}", seq_len=seq, preset="tiny", steps=2,
                    device="cpu", progress=False, tensorboard=False, memory=mem)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cpu, wall = time.process_time(), time.time()
loop.train(opts)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
config = get_preset("tiny")
est = estimate_cpu_memory(config, seq, mem, dtype_bytes=4)
items = est.gpu_total - est.gpu["reference ops (CPU)"] - sum(static_bytes(config, 4).values())
print(json.dumps({"seq": seq, "recompute": recompute, "growth": peak - before, "activation_items": items,
                  "plan_total": est.gpu_total, "cpu_s": time.process_time() - cpu, "wall_s": time.time() - wall}))
"""


def main() -> None:
    from genolong.units import parse_length

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="4k,8k")
    p.add_argument("--out", default=None, help="keep the per-run JSON lines here (default: a temporary directory)")
    args = p.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="cpu-memory-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for seq in [parse_length(s, "--seqs") for s in args.seqs.split(",")]:
        for recompute in (False, True):
            out = subprocess.run([sys.executable, "-c", CHILD, str(seq), str(int(recompute)), str(root)],
                                 capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "1", **_env()})
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    (root / "cpu_memory_plan.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gib = 1024**3
    print("| tokens | recompute | RSS growth GiB | plan activation items GiB | ratio | plan total GiB | CPU s | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq']} | {r['recompute']} | {r['growth'] / gib:.3f} | {r['activation_items'] / gib:.3f} | "
              f"{r['growth'] / r['activation_items']:.2f} | {r['plan_total'] / gib:.3f} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} |")
    print(f"logs: {root}/cpu_memory_plan.jsonl")


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


if __name__ == "__main__":
    main()
