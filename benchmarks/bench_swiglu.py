"""The MoE experts' clamped SwiGLU on one GPU: the eager expression vs the fused Triton pass
(genolong/kernels/moe/swiglu.py, GENOLONG_MOE_SWIGLU), forward alone and forward + backward.

    source .device/activate.sh && python benchmarks/bench_swiglu.py --out $OUT/swiglu

Per shape (all of a layer's (token, expert) rows at once): median ms, peak GiB above the inputs,
and the fused result's relative error against the eager one (h, d gate_up). Rows append to
<out>/swiglu.jsonl.

Prediction (written before the first run, 2026-12-02): at glm53-mini's 128k tokens x top-4 (512k
rows, expert width 256: [gate | up] 512 MiB in bf16) the eager forward moves ~2.3 GiB (four
kernels, each reading and writing [rows, 256]) and its backward ~5 GiB (the product's two sides,
silu's backward, two clamp masks, the halves concatenated); the fused passes move 0.77 and 1.3 GiB.
At ~2.5-3 TB/s: eager ~2.6-3 ms forward + backward, fused ~0.7 ms (3.5-4x); per 128k step (42 MoE
layers, the forward twice under full recompute) ~100 ms less, ~1% of the 8.2 s step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import measure  # noqa: E402

from genolong.kernels.moe import grouped as mg
from genolong.kernels.moe import swiglu as st  # noqa: E402

SHAPES = {"mini-128k": (131072 * 4, 256), "flash-64k": (65536 * 8, 2048)}  # rows (tokens x top-k), expert width
LIMIT = 10.0


def fwd_bwd(fn, gate_up, dh):
    leaf = gate_up.detach().requires_grad_()
    h = fn(leaf, LIMIT)
    h.backward(dh)
    return h, leaf.grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/swiglu"))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        rows, inter = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        gate_up = (torch.randn(rows, 2 * inter, generator=g, device="cuda") * 4).to(torch.bfloat16)
        dh = torch.randn(rows, inter, generator=g, device="cuda", dtype=torch.bfloat16)
        ref, got = fwd_bwd(mg.swiglu_eager, gate_up, dh), fwd_bwd(st.clamped_swiglu_packed, gate_up, dh)
        err = {n: float((a.float() - b.float()).norm() / b.float().norm()) for n, a, b in zip(("h", "d gate_up"), got, ref)}
        del ref, got
        for impl, fn in (("eager", mg.swiglu_eager), ("triton", st.clamped_swiglu_packed)):
            with torch.no_grad():
                fwd_ms, _ = measure(lambda: fn(gate_up, LIMIT), args.reps)
            ms_, peak = measure(lambda: fwd_bwd(fn, gate_up, dh), args.reps)
            row = {"shape": name, "swiglu": impl, "ms_fwd": round(fwd_ms, 3), "ms_fwd_bwd": round(ms_, 3), "peak_gib": round(peak, 3),
                   "triton_rel_err": err}
            print(json.dumps(row), flush=True)
            with open(args.out / "swiglu.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
