"""mHC's Sinkhorn backward on one GPU: the O(steps^2) recompute kernel vs the O(steps) kernel that
stores each half-step's sums (the default since 2026-12-02; genolong/kernels/mhc_sinkhorn.py, GENOLONG_SINKHORN_BWD).

    source .device/activate.sh && python benchmarks/bench_sinkhorn.py --out $OUT/sinkhorn

Per size: median ms of each backward kernel over [T, 4, 4] fp32 (glm53-mini's and GLM-5.3-Flash's
n = 4, 20 iterations: 39 half-steps), peak GiB above the inputs, and each kernel's relative error
against autograd through the reference in float64 on the first 8k tokens. Rows append to
<out>/sinkhorn.jsonl; a table prints last.

Prediction (written before the first run, 2026-12-02): the recompute kernel does ~1,500 half-steps
per token and costs ~1.46 ms a call at 128k (the H200 profile of 2026-12-02: 131.6 ms in 90 calls);
the stored kernel does 78 and moves ~1.4 KB per token (x, dy, dx and 39 x 4 sums written and
read back), ~190 MB at 128k: ~0.1-0.2 ms, 7-15x faster, ~120 ms less per 128k step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import measure  # noqa: E402

from genolong.kernels import mhc_sinkhorn as ms  # noqa: E402
from genolong.model.mhc import sinkhorn  # noqa: E402

SIZES = {"128k": 131072, "512k": 524288, "1m": 1048576}
ITERS, EPS = 20, 1e-6


def inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.softmax(torch.randn(tokens, 4, 4, generator=g, device="cuda") * 2, -1) + 1e-6
    return x, torch.randn(tokens, 4, 4, generator=g, device="cuda")


def errors(check_tokens: int = 8192) -> dict:
    x, dy = inputs(check_tokens, seed=1)
    ref_in = x.double().requires_grad_()
    sinkhorn(ref_in, ITERS, EPS).backward(dy.double())
    ref = ref_in.grad
    return {mode: float((ms.sinkhorn_backward(x, dy, ITERS, EPS, mode=mode).double() - ref).norm() / ref.norm()) for mode in ms.BACKWARDS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/sinkhorn"))
    ap.add_argument("--sizes", default="128k,512k")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    err = errors()
    rows = []
    for size in args.sizes.split(","):
        x, dy = inputs(SIZES[size])
        for mode in ms.BACKWARDS:
            ms_, peak = measure(lambda: ms.sinkhorn_backward(x, dy, ITERS, EPS, mode=mode), args.reps)
            row = {"size": size, "backward": mode, "ms": round(ms_, 4), "peak_gib": round(peak, 3), "rel_err_vs_fp64": err[mode]}
            rows.append(row)
            with open(args.out / "sinkhorn.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"{'size':>5} {'backward':>10} {'ms':>9} {'peak GiB':>9} {'rel err':>9}")
    for r in rows:
        print(f"{r['size']:>5} {r['backward']:>10} {r['ms']:>9.3f} {r['peak_gib']:>9.3f} {r['rel_err_vs_fp64']:>9.2e}")


if __name__ == "__main__":
    main()
