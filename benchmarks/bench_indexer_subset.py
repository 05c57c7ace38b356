"""Does scoring a random subset of the indexer's queries (--indexer-loss-queries F) slow its learning?

CPU, small, at equal steps: the same DSA layer (main weights fixed and large, so its attention is
peaked and there is something to find), its indexer first warmed up against dense attention
(--warmup-steps, as DeepSeek-V3.2 and `--indexer-warmup-steps`; the same start for every arm),
then the same fresh input every step for every arm, only the indexer trained (Adam, afresh) by
the sparse KL over its own selection, scored on every query (F = 1) or on a random share F of the
query blocks. Every --eval-every steps, on held-out inputs: the
indexer's mean KL over every query (F = 1, whatever the arm) and its recall (the share of dense
attention on the keys it selects, sampled queries). The block is scaled with the sequence: at
--seq 1024 and --block 64 a sequence has 16 blocks, as 32k has of QUERY_BLOCK = 2048 (128k: 64).
The inputs are hidden states of random tokens (a fixed embedding per token plus noise).

    python -m benchmarks.run indexer_subset                         # ~3 min on 2 CPU cores
    python -m benchmarks.run indexer_subset --fractions 1,0.25 --block 16 --eval-every 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from genolong.model import get_preset
from genolong.model.dsa import DSAAttention
from genolong.model.indexer_loss import DENSE, SPARSE, IndexerLossSwitch
from genolong.model.indexer_recall import RecallProbe


def layer(seed: int, topk: int) -> DSAAttention:
    torch.manual_seed(seed)
    attn = DSAAttention(64, get_preset("tiny", dsa={"indexer": {"topk": topk}}).dsa, 1e-5, layer_idx=0, has_indexer=True)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if not name.startswith("indexer.") and p.dim() > 1:
                p.normal_(0, 0.5)
    for name, p in attn.named_parameters():
        p.requires_grad_(name.startswith("indexer."))
    return attn


def inputs(seed: int, seq: int, vocab: int = 16) -> torch.Tensor:
    """Hidden states of random tokens: a fixed embedding per token (of `vocab`) plus a little noise,
    so that where attention looks depends on which tokens meet, as in a sequence of bases."""
    table = torch.randn(vocab, 64, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, seq), generator=g)
    return table[tokens] + 0.3 * torch.randn(1, seq, 64, generator=g)


def evaluate(attn, held_out, queries: int) -> tuple[float, float]:
    """(mean KL over every query, recall) over the held-out inputs; the gradients are discarded."""
    kls, recalls = [], []
    for x in held_out:
        switch = IndexerLossSwitch(SPARSE, 1.0)
        attn.indexer_loss, attn.recall_probe = switch, RecallProbe(queries)
        attn(x)[0].sum().backward()
        kls.append(float(switch.values[0]))
        recalls.append(attn.recall_probe.values[0])
        attn.zero_grad(set_to_none=True)
    attn.indexer_loss = attn.recall_probe = None
    return statistics.mean(kls), statistics.mean(recalls)


def warmed_up(args, seed: int) -> DSAAttention:
    """The layer after the dense warm-up (every arm of this seed starts from it)."""
    attn = layer(seed, args.topk)
    opt = torch.optim.Adam(attn.indexer.parameters(), lr=args.lr)
    for step in range(args.warmup_steps):
        attn.indexer_loss = IndexerLossSwitch(DENSE, 1.0)
        with torch.no_grad():
            attn(inputs(500_000 + 1000 * seed + step, args.seq))
        opt.step()
        opt.zero_grad(set_to_none=True)
    attn.indexer_loss = None
    return attn


def run(args, start: dict, fraction: float, seed: int) -> list[dict]:
    attn = layer(seed, args.topk)
    attn.load_state_dict(start)
    opt = torch.optim.Adam(attn.indexer.parameters(), lr=args.lr)
    held_out = [inputs(10_000 + 100 * seed + i, args.seq) for i in range(args.held_out)]
    curve = []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0:
            kl, recall = evaluate(attn, held_out, args.queries)
            curve.append({"step": step, "kl": kl, "recall": recall})
        if step == args.steps:
            break
        attn.indexer_loss = IndexerLossSwitch(SPARSE, 1.0, query_fraction=fraction, query_block=args.block, seed=seed, step=step)
        attn(inputs(1000 * seed + step, args.seq))[0].sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        attn.indexer_loss = None
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", default="1,0.5,0.25")
    ap.add_argument("--seeds", default="0,1,2,3,4,5")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--topk", type=int, default=64, help="keys each query selects (16 pools of 4)")
    ap.add_argument("--warmup-steps", type=int, default=0, help="dense warm-up steps before the sparse stage (0: none)")
    ap.add_argument("--steps", type=int, default=300, help="sparse steps, the arms compared")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--held-out", type=int, default=2, help="held-out sequences")
    ap.add_argument("--queries", type=int, default=256, help="sampled queries per held-out sequence for the recall")
    ap.add_argument("--out", type=Path, default=Path("runs/indexer_subset"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    rows = []
    seeds = [int(s) for s in args.seeds.split(",")]
    starts = {seed: {k: v.clone() for k, v in warmed_up(args, seed).state_dict().items()} for seed in seeds}
    for fraction in (float(f) for f in args.fractions.split(",")):
        for seed in seeds:
            t0 = time.monotonic()
            curve = run(args, starts[seed], fraction, seed)
            rows.append({"fraction": fraction, "seed": seed, "curve": curve, "seconds": round(time.monotonic() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    table = {}
    for row in rows:
        for point in row["curve"]:
            table.setdefault((row["fraction"], point["step"]), []).append(point)
    print("fraction step  KL (mean, sd over seeds)  recall (mean, sd)")
    for (fraction, step), points in sorted(table.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        kl, rec = [p["kl"] for p in points], [p["recall"] for p in points]
        sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0  # noqa: E731
        print(f"{fraction:8.2f} {step:4d}  {statistics.mean(kl):.4f} {sd(kl):.4f}  {statistics.mean(rec):.4f} {sd(rec):.4f}")
    # Paired by seed (same start, same inputs): each arm's recall minus the first arm's, mean and its standard error.
    first = rows[0]["fraction"]
    base = {(r["seed"], p["step"]): p for r in rows if r["fraction"] == first for p in r["curve"]}
    print(f"recall minus the {first:g} arm's, paired by seed: mean, standard error")
    for (fraction, step), points in sorted(table.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        if fraction == first:
            continue
        diffs = [r_p["recall"] - base[(r["seed"], r_p["step"])]["recall"]
                 for r in rows if r["fraction"] == fraction for r_p in r["curve"] if r_p["step"] == step]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
        print(f"{fraction:8.2f} {step:4d}  {statistics.mean(diffs):+.4f} {se:.4f}")
    summary = {"args": vars(args) | {"out": str(args.out)}, "rows": rows, "seconds": round(time.monotonic() - start, 1)}
    (args.out / "indexer_subset.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
