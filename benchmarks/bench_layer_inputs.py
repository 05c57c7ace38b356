"""Does storing the saved layer inputs in fp8 (`--layer-inputs fp8`) change the loss curve?

CPU, small, paired: the tiny preset (4 layers, hidden 64; the CPU reference ops, fp32 compute) trained
from the same initialisation on the same windows of the bundled genome (E. coli 536) for --steps steps,
once with the layer inputs stored as they are (exact: fp32 here) and once in fp8 (e4m3, one fp32 scale
per row of hidden), every layer's input offloaded (a pageable copy on the CPU) so that the offloader's
fp8 path runs for each. Full recompute, so backward recomputes every layer from its stored input; the
forward, and so each step's loss given the weights, is the same in both: only the gradients differ,
and the curves part as the weights do. Printed: each arm's training loss over the last --last steps
(mean over them, per seed), the difference fp8 - exact per seed (min, max, and a bootstrap 95% interval
of the mean over seeds), the held-out loss (phage lambda windows) at the end, and the curves in bins.

    python -m benchmarks.run layer_inputs                      # ~4 min on 2 CPU cores
    python -m benchmarks.run layer_inputs --steps 400 --seeds 0,1,2,3,4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from genolong.data import BUNDLED_HOLDOUT, BUNDLED_TRAIN, WindowSampler, bundled_genome_path, open_prepared, prepare
from genolong.model import GenoLongForCausalLM, get_preset
from genolong.train.loss import chunked_lm_loss
from genolong.train.memory import apply_memory_optimizations
from genolong.train.options import MemoryOptions
from genolong.vocab import N_ID

ARMS = ("bf16", "fp8")  # "bf16": stored as they are (the run's dtype, fp32 on the CPU)


def batch(sampler: WindowSampler, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.from_numpy(sampler.window(k).tokens.astype("int64"))[None]
    return ids[:, :-1], ids[:, 1:]


def loss_of(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return chunked_lm_loss(model.hidden_states(inputs), model.lm_head.weight, targets, targets != N_ID, 4096)


def train(args, pg, arm: str, seed: int) -> dict:
    config = get_preset("tiny")
    torch.manual_seed(seed)
    model = GenoLongForCausalLM(config)
    handle = apply_memory_optimizations(model, MemoryOptions(offload_layers=config.num_layers, layer_inputs=arm))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    windows = WindowSampler(pg, "train", length=args.seq + 1, seed=1000 + seed)
    curve = []
    for step in range(args.steps):
        handle.reset_stats()
        loss = loss_of(model, *batch(windows, step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(loss.detach().item())
    stored = handle.stats.quantized_bytes if arm == "fp8" else handle.stats.bytes_down  # the last step's
    held = WindowSampler(pg, "holdout", length=args.seq + 1, seed=7)
    with torch.no_grad():
        held_out = statistics.mean(float(loss_of(model, *batch(held, k))) for k in range(args.held_out))
    return {"arm": arm, "seed": seed, "curve": curve, "held_out": held_out, "stored_bytes_last_step": stored}


def bootstrap(values: list[float], draws: int = 10000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile interval of the mean of `values` (resampled with replacement)."""
    rng = random.Random(seed)
    means = sorted(statistics.mean(rng.choices(values, k=len(values))) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--last", type=int, default=50, help="the steps whose mean loss is compared")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--held-out", type=int, default=8, help="held-out windows scored at the end")
    ap.add_argument("--bin", type=int, default=25, help="steps per printed point of the curves")
    ap.add_argument("--out", type=Path, default=Path("runs/layer_inputs"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pg = open_prepared(prepare(bundled_genome_path(), Path(tmp) / "genome", train=BUNDLED_TRAIN, holdout=BUNDLED_HOLDOUT,
                                   progress=False, log=lambda _m: None))
        for seed in (int(s) for s in args.seeds.split(",")):
            for arm in ARMS:
                t0 = time.monotonic()
                rows.append(train(args, pg, arm, seed) | {"seconds": round(time.monotonic() - t0, 1)})
                r = rows[-1]
                print(json.dumps({k: v for k, v in r.items() if k != "curve"} | {"last_mean": statistics.mean(r["curve"][-args.last:])}),
                      flush=True)
    by = {(r["arm"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    last = {key: statistics.mean(r["curve"][-args.last:]) for key, r in by.items()}
    print(f"training loss, mean of the last {args.last} of {args.steps} steps (seq {args.seq}, tiny preset, fp32 compute):")
    print("seed   exact     fp8       fp8 - exact   held-out exact / fp8")
    diffs, held = [], []
    for seed in seeds:
        d = last[("fp8", seed)] - last[("bf16", seed)]
        diffs.append(d)
        held.append(by[("fp8", seed)]["held_out"] - by[("bf16", seed)]["held_out"])
        print(f"{seed:4d}   {last[('bf16', seed)]:.5f}   {last[('fp8', seed)]:.5f}   {d:+.5f}      "
              f"{by[('bf16', seed)]['held_out']:.5f} / {by[('fp8', seed)]['held_out']:.5f}")
    lo, hi = bootstrap(diffs)
    summary = {
        "exact_mean": statistics.mean(last[("bf16", s)] for s in seeds),
        "fp8_mean": statistics.mean(last[("fp8", s)] for s in seeds),
        "diff_mean": statistics.mean(diffs), "diff_min": min(diffs), "diff_max": max(diffs), "diff_bootstrap_95": [lo, hi],
        "held_out_diff_mean": statistics.mean(held), "held_out_diff_min": min(held), "held_out_diff_max": max(held),
    }
    print(f"mean over seeds: exact {summary['exact_mean']:.5f}, fp8 {summary['fp8_mean']:.5f}; fp8 - exact {summary['diff_mean']:+.5f} "
          f"(min {min(diffs):+.5f}, max {max(diffs):+.5f}, bootstrap 95% [{lo:+.5f}, {hi:+.5f}]); held-out fp8 - exact "
          f"{summary['held_out_diff_mean']:+.5f} (min {min(held):+.5f}, max {max(held):+.5f})")
    print(f"curves (mean over seeds, per {args.bin} steps): step  exact  fp8")
    for a in range(0, args.steps, args.bin):
        mean = lambda arm: statistics.mean(statistics.mean(by[(arm, s)]["curve"][a : a + args.bin]) for s in seeds)  # noqa: E731
        print(f"{a + args.bin:5d}  {mean('bf16'):.4f}  {mean('fp8'):.4f}")
    stored = {arm: by[(arm, seeds[0])]["stored_bytes_last_step"] for arm in ARMS}
    print(f"stored layer-input bytes a step: exact {stored['bf16']}, fp8 {stored['fp8']}")
    out = {"args": vars(args) | {"out": str(args.out)}, "summary": summary, "rows": rows, "seconds": round(time.monotonic() - start, 1)}
    (args.out / "layer_inputs.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
