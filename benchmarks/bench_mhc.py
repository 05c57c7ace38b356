"""mHC around one layer's two sublayers on one GPU: the eager reference vs the fused Triton passes
(genolong/kernels/mhc/fused.py), optionally vs torch.compile, at glm53-mini's and GLM-5.3-Flash's width.

    source .device/activate.sh && python benchmarks/bench_mhc.py --out $OUT/mhc [--compiled] [--budget-s 150]

A cell is a layer's mHC work with the sublayers replaced by a product with a fixed tensor, as in
bench_real_layers.py: (mix + collapse, sublayer, expand) twice, forward and forward + backward,
bf16 streams [1, T, 4, hidden], B = 1. Per cell: median ms of forward (grad enabled) and of
forward + backward, peak GiB above the inputs, the bytes the fused passes must move at least
(module docstring of mhc_fused: per sublayer forward 2 reads of the streams + the collapsed
write, 1 read + 1 write for the expand and the sublayer output; backward 3 reads of the streams
for the mix/collapse and its dx write, 1 read of the streams, the gradient and the sublayer
output plus 2 writes for the expand; autograd's sum of the two stream gradients 2 reads + 1
write), the effective TB/s from them, and the fused vs reference parity at that shape (relative
error of the new streams and of the input gradient, both against the reference in fp32 on the
first 8k tokens). Rows append to <out>/mhc.jsonl; a table prints last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import measure  # noqa: E402

import genolong.kernels as kernels  # noqa: E402
from genolong.model import ops  # noqa: E402
from genolong.model.config import MHCConfig  # noqa: E402
from genolong.model.mhc import HyperConnection  # noqa: E402

DEV = "cuda"
GIB = 1024**3
SIZES = {"32k": 32768, "128k": 131072, "512k": 524288}


def pair(hidden: int, compiled: bool = False):
    """Two hyper-connections (a layer's) with random weights: fn std 0.02 in fp32 as the model keeps it."""
    hcs = []
    for _ in range(2):
        hc = HyperConnection(hidden, MHCConfig(), rms_eps=1e-6).to(DEV)
        with torch.no_grad():
            hc.fn.normal_(0.0, 0.02)
            hc.base.normal_(0.0, 0.1)
        if compiled:
            from genolong.train.compile import apply_compile

            apply_compile(hc)
        hcs.append(hc)
    return hcs


def layer_mhc(hcs, streams, outs):
    s = streams
    for hc, out in zip(hcs, outs):
        post, comb, x = hc(s)
        s = hc.expand(post, comb, x * out, s)
    return s


def floor_bytes(hidden: int, seq: int, n: int = 4, itemsize: int = 2) -> tuple[float, float]:
    """(forward, backward) bytes a layer's two fused sublayers must move at least (module docstring)."""
    streams, row = n * hidden * seq * itemsize, hidden * seq * itemsize
    fwd = 2 * ((2 * streams + row) + (streams + row + streams))
    bwd = 2 * ((3 * streams + row + streams) + (streams + streams + row + row + streams) + 3 * streams)
    return fwd, bwd


def parity(hidden: int, tokens: int = 8192) -> dict:
    """Fused (bf16) and reference (bf16) against the reference in fp32: new streams and d streams."""
    torch.manual_seed(0)
    hcs = pair(hidden)
    streams = torch.randn(1, tokens, 4, hidden, device=DEV)
    outs = [torch.randn(1, tokens, hidden, device=DEV) for _ in hcs]
    weight = torch.randn(1, tokens, 4, hidden, device=DEV)

    def run(policy: str, dtype):
        s = streams.detach().to(dtype).requires_grad_()  # a new leaf per run, also in fp32
        with ops.policy(policy):
            new = layer_mhc(hcs, s, [o.to(dtype) for o in outs])
        (new.float() * weight).sum().backward()
        return new.float(), s.grad.float()

    truth = run("reference", torch.float32)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    res = {}
    for name, policy in (("fused", "fused"), ("reference", "reference")):
        new, grad = run(policy, torch.bfloat16)
        res[name] = {"new": rel(new, truth[0]), "d_streams": rel(grad, truth[1])}
    return res


def cell(impl: str, hidden: int, size: str, reps: int) -> dict:
    seq = SIZES[size]
    hcs = pair(hidden, compiled=impl == "compiled")
    streams = torch.randn(1, seq, 4, hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    outs = [torch.randn(1, seq, hidden, device=DEV, dtype=torch.bfloat16) for _ in hcs]
    policy = "fused" if impl == "fused" else "reference"
    audit = {}  # which implementation each op ran (the fused policy raises rather than fall back)

    def fwd():
        with ops.policy(policy) as p:
            out = layer_mhc(hcs, streams, outs)
        audit.update(p.audit_summary())
        return out

    def both():
        streams.grad = None
        out = fwd()
        out.backward(torch.ones_like(out))

    both()  # compiles outside the timing
    fwd_ms, _ = measure(lambda: fwd(), reps)
    both_ms, peak = measure(both, reps)
    f_bytes, b_bytes = floor_bytes(hidden, seq)
    row = {"impl": impl, "hidden": hidden, "size": size, "fwd_ms": round(fwd_ms, 2), "fwd_bwd_ms": round(both_ms, 2),
           "peak_gib": round(peak, 2), "floor_gib": round((f_bytes + b_bytes) / GIB, 1),
           "tb_per_s": round((f_bytes + b_bytes) / (both_ms / 1e3) / 1e12, 2), "audit": audit}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/mhc"))
    ap.add_argument("--cells", default="1024:128k,1024:512k,4096:128k", help="hidden:size pairs")
    ap.add_argument("--compiled", action="store_true", help="also time the torch.compile pass (minutes of compiling)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no cell after this many seconds")
    args = ap.parse_args()
    kernels.load()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "mhc.jsonl"
    start, rows = time.time(), []
    impls = ["fused", "reference"] + (["compiled"] if args.compiled else [])
    for spec in args.cells.split(","):
        hidden, size = spec.split(":")
        hidden = int(hidden)
        checks = parity(hidden)
        print(f"parity hidden {hidden}: {json.dumps(checks)}", flush=True)
        with log.open("a") as f:
            f.write(json.dumps({"parity": checks, "hidden": hidden}) + "\n")
        for impl in impls:
            if time.time() - start > args.budget_s:
                row = {"impl": impl, "hidden": hidden, "size": size, "not_run": "time budget"}
            else:
                try:
                    row = cell(impl, hidden, size, args.reps)
                except torch.OutOfMemoryError as e:
                    row = {"impl": impl, "hidden": hidden, "size": size, "not_run": f"out of memory: {str(e)[:120]}"}
                    torch.cuda.empty_cache()
            torch.cuda.empty_cache()  # the cell's tensors, before the next one's
            rows.append(row)
            print(json.dumps(row), flush=True)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print("\n| hidden | size | impl | fwd ms | fwd+bwd ms | peak GiB | TB/s of the floor's bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "not_run" in r:
            print(f"| {r['hidden']} | {r['size']} | {r['impl']} | not run: {r['not_run']} | | | |")
        else:
            print(f"| {r['hidden']} | {r['size']} | {r['impl']} | {r['fwd_ms']} | {r['fwd_bwd_ms']} | {r['peak_gib']} | {r['tb_per_s']} |")


if __name__ == "__main__":
    main()
