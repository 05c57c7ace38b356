"""The DSA indexer's KL loss on one GPU (glm53-mini shapes): correctness first, then its cost.

    source .device/activate.sh && python benchmarks/bench_indexer_loss.py --sizes 128k,512k --out $OUT/indexer_loss

1. Correctness at --check-seq (16k): the TileLang sparse attention's lse against the reference's,
   and the fused "dsa_indexer_loss" op (Triton) against its PyTorch reference (KL per query and the
   three gradients, relative Frobenius error; the reference reads the same bf16 values in fp32).
   A failure is recorded and stops the script before any timing (exit code 1).
2. At each size: the fused op alone (the loss and gradient of every query of one layer), and a
   glm53-mini DSA layer (fused indexer top-k + TileLang attention) forward + backward without and
   with the indexer loss (coeff 1): extra ms and extra peak GiB above the inputs.
3. At --warmup-sizes (16k): the dense warm-up, a DSA layer forward under no_grad without and with
   the dense KL and its backward into the indexer (O(T^2): PyTorch, chunked over queries).
The whole-step overhead is measured by benchmarks/bench_train.py --indexer-loss-coeff 1; the
"11 layers" column here is only the layer overhead times glm53-mini's 11 DSA layers.
Time: ~2.5 min on the H200 with the kernel caches warm (a first TileLang build adds ~1.5 min).
Median of --reps after one warm-up, CUDA events. Logs: OUT/log.jsonl (one line per measurement),
OUT/summary.json, OUT/table.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels import SIZES, fwd_bwd, init_, measure  # noqa: E402

import genolong.kernels  # noqa: E402
from genolong.model import get_preset, ops  # noqa: E402
from genolong.model.dsa import DSAAttention  # noqa: E402
from genolong.model.indexer_loss import DENSE, SPARSE, IndexerLossSwitch  # noqa: E402

DEV = "cuda"
DTYPE = torch.bfloat16
GIB = 1024**3
BOUND = 2e-2  # bf16 inputs against an fp32 reference of the same values


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if torch.isfinite(a).all() else float("inf")


def op_inputs(cfg, seq: int, seed: int = 0):
    """Random glm53-mini-shaped inputs of one layer's loss, with the fused indexer's selection and
    the TileLang attention's lse."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    ix, heads, latent = cfg.dsa.indexer, cfg.dsa.num_heads, cfg.dsa.kv_lora_rank
    q = torch.randn(1, seq, heads, latent, device=DEV, generator=g).to(DTYPE)
    kv = torch.randn(1, seq, latent, device=DEV, generator=g).to(DTYPE)
    iq = (torch.randn(1, seq, ix.n_heads, ix.head_dim, device=DEV, generator=g) * 0.3 + 1.0).to(DTYPE)
    pk = (torch.randn(1, seq // ix.kpool, ix.head_dim, device=DEV, generator=g) * 0.3 + 1.0).to(DTYPE)
    w = torch.randn(1, seq, ix.n_heads, device=DEV, generator=g) * ix.n_heads**-0.5
    idx = ops.call("dsa_indexer_topk", 0, iq, pk, w, kpool=ix.kpool, topk_pools=ix.topk_pools, always_select_tail=True,
                   softmax_scale=ix.head_dim**-0.5)
    scale = cfg.dsa.softmax_scale
    with torch.no_grad():
        _, lse = ops.call("dsa_sparse_attention", 0, q, kv, idx, scale=scale, return_lse=True)
    kw = dict(kpool=ix.kpool, topk_pools=ix.topk_pools, index_scale=ix.head_dim**-0.5, scale=scale, grad_scale=1.0 / seq)
    return (iq, pk, w, q, kv, idx, lse), kw


def check(cfg, seq: int) -> dict:
    args, kw = op_inputs(cfg, seq)
    iq, pk, w, q, kv, idx, lse = args
    ref_attn = ops.implementations("dsa_sparse_attention")["reference"]
    _, ref_lse = ref_attn(q.float(), kv.float(), idx, scale=kw["scale"], return_lse=True)
    live = torch.isfinite(ref_lse)
    out = {"seq": seq, "lse_max_abs_diff": (lse[live] - ref_lse[live]).abs().max().item(),
           "lse_inf_rows_agree": bool(torch.equal(torch.isfinite(lse), live))}
    fused = ops.implementations("dsa_indexer_loss")["triton_pool_kl"](*args, **kw)
    wide = [a.float() if a.is_floating_point() and a is not lse else a for a in args]
    wide[-1] = ref_lse
    ref = ops.implementations("dsa_indexer_loss")["reference"](*wide, **kw)
    for name, a, b in zip(("kl", "d_index_q", "d_pool_keys", "d_head_weights"), fused, ref):
        out[f"rel_{name}"] = _rel(a, b)
    out["ok"] = out["lse_max_abs_diff"] < 5e-2 and out["lse_inf_rows_agree"] and all(
        out[k] <= BOUND for k in out if k.startswith("rel_"))
    return out


def layer(cfg):
    return init_(DSAAttention(cfg.hidden, cfg.dsa, cfg.rms_eps, layer_idx=3, has_indexer=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="128k,512k")
    ap.add_argument("--check-seq", type=int, default=16384)
    ap.add_argument("--warmup-sizes", default="16k")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=220)
    ap.add_argument("--out", type=Path, default=Path("runs/indexer_loss"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    log = open(args.out / "log.jsonl", "w", encoding="utf-8")
    summary: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "device": torch.cuda.get_device_name(), "not_run": [], "rows": []}

    def record(row: dict) -> None:
        row = {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}
        summary["rows"].append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row), flush=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")

    genolong.kernels.load()
    ops.use("fused")
    cfg = get_preset("glm53-mini")
    n_dsa = len(cfg.dsa_layers)

    verdict = check(cfg, args.check_seq)
    record({"phase": "check", **verdict})
    if not verdict["ok"]:
        print(f"fused indexer loss does not match the reference: {verdict}", file=sys.stderr)
        return 1

    table = ["| length | fused op | DSA layer fwd+bwd | with indexer loss | extra | extra peak | x11 layers |", "|---|---|---|---|---|---|---|"]
    for name in [s for s in args.sizes.split(",") if s]:
        seq = SIZES[name]
        if time.monotonic() - start > args.budget_s - (120 if seq >= 512 * 1024 else 40):
            summary["not_run"].append(f"{name}: time budget")
            continue
        op_args, kw = op_inputs(cfg, seq)
        op_ms, op_gib = measure(lambda: ops.call("dsa_indexer_loss", 0, *op_args, **kw), args.reps)
        record({"phase": "op", "seq": seq, "ms": op_ms, "peak_gib": op_gib, "impl": ops.audit().get((0, "dsa_indexer_loss"))})
        del op_args
        torch.cuda.empty_cache()

        attn = layer(cfg)
        x = (torch.randn(1, seq, cfg.hidden, device=DEV) * 0.5).to(DTYPE).requires_grad_()
        base_ms, base_gib = measure(fwd_bwd(attn, x, pick=lambda o: o[0]), args.reps)
        attn.indexer_loss = IndexerLossSwitch(SPARSE, 1.0)
        loss_ms, loss_gib = measure(fwd_bwd(attn, x, pick=lambda o: o[0]), args.reps)
        kl = float(attn.indexer_loss.values[3]) / (args.reps + 1)
        grads_ok = all(p.grad is not None and torch.isfinite(p.grad).all().item() for p in attn.indexer.parameters())
        row = {"phase": "layer", "seq": seq, "base_ms": base_ms, "loss_ms": loss_ms, "extra_ms": loss_ms - base_ms,
               "extra_pct": 100 * (loss_ms - base_ms) / base_ms, "base_peak_gib": base_gib, "loss_peak_gib": loss_gib,
               "extra_peak_gib": loss_gib - base_gib, "mean_kl": kl, "indexer_grads_finite": grads_ok,
               "kernels": {op: impl for (_, op), impl in ops.audit().items()}}
        record(row)
        table.append(f"| {name} | {op_ms:.1f} ms / {op_gib:.2f} GiB | {base_ms:.1f} ms / {base_gib:.2f} GiB | {loss_ms:.1f} ms / "
                     f"{loss_gib:.2f} GiB | +{loss_ms - base_ms:.1f} ms ({row['extra_pct']:+.1f}%) | {loss_gib - base_gib:+.2f} GiB | "
                     f"+{n_dsa * (loss_ms - base_ms) / 1000:.2f} s |")
        del attn, x
        torch.cuda.empty_cache()
    for name in [s for s in args.warmup_sizes.split(",") if s]:
        seq = SIZES[name]
        if time.monotonic() - start > args.budget_s - 30:
            summary["not_run"].append(f"warm-up {name}: time budget")
            continue
        attn = layer(cfg)
        x = (torch.randn(1, seq, cfg.hidden, device=DEV) * 0.5).to(DTYPE)

        def forward():
            with torch.no_grad():
                attn(x)

        base_ms, base_gib = measure(forward, args.reps)
        attn.indexer_loss = IndexerLossSwitch(DENSE, 1.0)
        dense_ms, dense_gib = measure(forward, args.reps)
        record({"phase": "warmup", "seq": seq, "forward_ms": base_ms, "dense_warmup_ms": dense_ms, "extra_ms": dense_ms - base_ms,
                "forward_peak_gib": base_gib, "dense_warmup_peak_gib": dense_gib})
        table.append(f"| {name} warm-up | - | fwd (no_grad) {base_ms:.1f} ms / {base_gib:.2f} GiB | + dense KL {dense_ms:.1f} ms / "
                     f"{dense_gib:.2f} GiB | +{dense_ms - base_ms:.1f} ms | {dense_gib - base_gib:+.2f} GiB | +{n_dsa * (dense_ms - base_ms) / 1000:.2f} s |")
        del attn, x
        torch.cuda.empty_cache()
    summary["table"] = table
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (args.out / "table.txt").write_text("\n".join(table) + "\n", encoding="utf-8")
    print("\n".join(table))
    if summary["not_run"]:
        print("not run:", "; ".join(summary["not_run"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
