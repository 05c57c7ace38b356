"""The MoE router's top-k on one GPU: torch.topk (PyTorch's radix select, the default) vs the
Triton kernel (genolong/kernels/moe/router_topk.py, GENOLONG_ROUTER_TOPK=triton), side by side.

    source .device/activate.sh && python benchmarks/bench_router_topk.py --out $OUT/router_topk

Per shape (one call's scores: a MoE chunk's tokens x experts, fp32): median ms of each, and
whether the kernel picked torch.topk's experts (as sets per row; the scores are random, so no ties).
Rows append to <out>/router_topk.jsonl.

Prediction (written before the first run, 2026-12-05): the H200 128k profile of 2026-12-03 has
`gatherTopK` at 59.9 ms over 252 calls (64k tokens x 64 experts, top 4: 0.24 ms for 16 MiB of
scores); the kernel reads the scores once and writes 2 MiB of indices, ~0.01-0.02 ms at 2-3 TB/s,
so ~15x faster per call and ~55 ms less a 128k step (~0.9%), ~0.22 s at 512k.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import measure  # noqa: E402

from genolong.kernels.moe.router_topk import router_topk_triton  # noqa: E402

# tokens, experts, k: glm53-mini's MoE chunk at 128k (2 chunks a layer) and a whole 512k sequence;
# a GLM-5.3-Flash-sized router (256 routed experts, top 8) at 64k tokens.
SHAPES = {"mini-chunk": (65536, 64, 4), "mini-512k": (524288, 64, 4), "flash-64k": (65536, 256, 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/router_topk"))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "router_topk.jsonl").open("a")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: {name!r} is not one of {', '.join(SHAPES)}")
        tokens, experts, k = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        scores = torch.rand(tokens, experts, generator=g, device="cuda")
        same = torch.equal(router_topk_triton(scores, k).sort(-1).values, scores.topk(k, dim=-1, sorted=False).indices.sort(-1).values)
        row = dict(shape=name, tokens=tokens, experts=experts, k=k, same_experts=same)
        for impl, fn in (("torch.topk", lambda: scores.topk(k, dim=-1, sorted=False)), ("triton", lambda: router_topk_triton(scores, k))):
            row[f"{impl} ms"] = round(measure(fn, args.reps)[0], 4)
        row["speedup"] = round(row["torch.topk ms"] / row["triton ms"], 2)
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
