"""Indexer arms on the copy task: the same DSA model with its indexer frozen, after the dense warm-up,
and after the sparse KL, scored on copies at fixed distances against an oracle selection.

    python benchmarks/copy_indexer_arms.py --model A4 --warmup-steps 300 --sparse-steps 300 --out arms.json

The model is a copy-probe model whose DSA layer learned to copy from a sparse selection
(benchmarks/copy_task_probe.py --oracle-selection, docs/recall.md "CPU, fourth attempt"). Only the
indexer's weights ever change here (the optimizer holds nothing else), so the arms differ in what
the selection holds and in nothing else. For each arm and distance: the copy loss after the copy's
first 8 bases, and the share of copy queries whose selection holds the key they need (the source
base they predict). The oracle row selects that key's pool by construction; the dense row selects
every key.
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from copy_dna import DnaRows
from copy_task_probe import copy_batch, hold_dsa_post, oracle_topk, plant
from genolong.model import GenoLongForCausalLM, from_pretrained, ops, save_pretrained
from genolong.model.indexer import indexer_topk_reference
from genolong.model.presets import apply_overrides
from genolong.train.indexer import IndexerTraining, indexer_layers


def fixed_gap_batch(batch: int, length: int, max_gap: int, gap: int, layout: dict, source=None, window: int = 0):
    """copy_batch's rows with every gap = `gap` (the copy `length + gap` after its source); `source` and
    `window` as copy_batch's (with a window, the block at a random offset of each row)."""
    n = max(2 * length + max_gap, window)
    ids = source(batch, n) if source is not None else torch.randint(0, 4, (batch, n))
    if window:
        start = torch.randint(0, n - 2 * length - gap + 1, (batch,))
    else:
        start = torch.full((batch,), max_gap - gap)
    plant(ids, start, gap, length, layout)
    return ids


def score(lm, args, gap: int, selection: str, layout: dict) -> dict:
    """Copy bits after the copy's first 8 bases, the same offsets' bits at the first occurrence, and the
    needed key's hit rate, `args.eval_batches` x `args.eval_rows` rows (with --dna: held-out DNA, the
    same windows for every arm and selection)."""
    seen = {}

    def watching(*a, **kw):  # the frozen / trained indexer, its selection recorded
        out = indexer_topk_reference(*a, **kw)
        seen["idx"] = out
        return out

    impl = {"indexer": watching, "oracle": oracle_topk(layout), "dense": None}[selection]
    model = lm
    if selection == "dense":
        n = max(2 * args.length + args.max_gap, args.window)
        model = GenoLongForCausalLM(apply_overrides(lm.config, {"dsa": {"indexer": {"topk": 4 * ((n + 3) // 4)}}}))
        model.load_state_dict(lm.state_dict())
        model.to(args.device)
        model.eval()
    else:
        ops.register("dsa_indexer_topk", ops.REFERENCE, impl)
    gen = torch.random.get_rng_state()
    torch.manual_seed(1000 + gap)
    source = None
    if args.dna:
        source = DnaRows(args.dna, args.dna_eval_split, seed=1000 + gap).rows
    bits, count, hits, queries, first_bits = 0.0, 0, 0, 0, 0.0
    try:
        rows = args.eval_rows
        for _ in range(args.eval_batches):
            ids = fixed_gap_batch(rows, args.length, args.max_gap, gap, layout, source, args.window).to(args.device)
            with torch.no_grad():
                logits = model(ids[:, :-1]).logits
            loss = F.cross_entropy(logits[..., :4].float().reshape(-1, 4), ids[:, 1:].reshape(-1), reduction="none").view(rows, -1)
            t = torch.arange(ids.shape[1] - 1, device=ids.device)
            copy_start = layout["copy_start"][:, None].to(ids.device)
            late = (t >= copy_start - 1 + 8) & (t < copy_start - 1 + args.length)
            bits += float(loss[late].sum()) / math.log(2)
            count += int(late.sum())
            start = layout["start"][:, None].to(ids.device)
            first = (t >= start - 1 + 8) & (t < start - 1 + args.length)  # the same offsets of the first occurrence
            first_bits += float(loss[first].sum()) / math.log(2)
            if selection == "indexer":
                needed = t[None, :] - (copy_start - layout["start"][:, None].to(ids.device)) + 1  # the source base each query predicts
                held = (seen["idx"] == needed.unsqueeze(-1)).any(-1)
                hits += int(held[late].sum())
                queries += int(late.sum())
    finally:
        ops.register("dsa_indexer_topk", ops.REFERENCE, indexer_topk_reference)
        torch.random.set_rng_state(gen)
    row = {"gap": gap, "distance": args.length + gap, "selection": selection, "copy_bits": round(bits / count, 4),
           "first_bits": round(first_bits / count, 4)}
    if queries:
        row["needed_key_selected"] = round(hits / queries, 4)
    return row


def train_indexer(lm, args, steps: int, phase: str, log) -> list[dict]:
    """`steps` optimizer steps on the indexer only: dense warm-up (the model forward under no_grad) or
    the sparse KL (the LM loss's backward carries it; nothing but the indexer is in the optimizer)."""
    training = IndexerTraining(lm, coeff=1.0, warmup_steps=steps if phase == "warmup" else 0, recall_every=args.every)
    # The optimizer holds only the indexer; the rest keeps requires_grad (the sparse KL rides on the LM
    # loss's backward) and its gradients are dropped every step.
    params = [p for name, p in lm.named_parameters() if ".self_attn.indexer." in name]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    curve, layout, t0 = [], {}, time.time()
    source = DnaRows(args.dna, "train", seed=args.seed + (0 if phase == "warmup" else 1)).rows if args.dna else None
    for step in range(steps):
        ids, _first, copy_mask = copy_batch(args.batch, args.length, args.max_gap, layout, source, args.window)
        ids, copy_mask = ids.to(args.device), copy_mask.to(args.device)
        training.begin_step(step)
        training.micro_batch(1.0)
        with training.forward_context():
            logits = lm(ids[:, :-1]).logits
        if training.backward_lm_loss():
            loss = F.cross_entropy(logits[..., :4].float().reshape(-1, 4), ids[:, 1:].reshape(-1), reduction="none").view(args.batch, -1)
            loss[copy_mask].mean().backward()  # the indexer's part is its sparse KL (the LM loss never reaches it)
        opt.step()
        lm.zero_grad(set_to_none=True)
        metrics = training.end_step()
        out_of_time = args.phase_budget_s is not None and time.time() - t0 > args.phase_budget_s
        if step % args.every == 0 or step == steps - 1 or out_of_time:
            curve.append({"step": step, "indexer_loss": metrics.get("indexer_loss"), "indexer_recall": metrics.get("indexer_recall")})
            log(f"{phase} step {step}: KL {metrics.get('indexer_loss')}, selection's share of dense attention {metrics.get('indexer_recall')}")
        if out_of_time and step < steps - 1:
            log(f"{phase}: stopped for time after {step + 1} of {steps} steps")
            curve.append({"stopped_for_time_after_steps": step + 1})
            break
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--topk", type=int, default=None,
                   help="the arms' indexer top-k (default: the model's own); the oracle row holds the needed pool plus "
                   "random ones up to the same size")
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--max-gap", type=int, default=192)
    p.add_argument("--gaps", default="0,64,128,192")
    p.add_argument("--window", type=int, default=0,
                   help="rows of this many bases with the copy block at a random offset (copy_task_probe's --window)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--sparse-steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--eval-rows", type=int, default=8, help="rows per evaluation batch (fewer for long windows)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--phase-budget-s", type=float, default=None,
                   help="end each training phase (warm-up, sparse) after this many seconds; the curve records where")
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dna", default=None, metavar="PREPARED",
                   help="real DNA rows (copy_dna.DnaRows): the indexer trains on the train split, the arms are scored on "
                   "--dna-eval-split")
    p.add_argument("--dna-eval-split", default="holdout")
    p.add_argument("--save-arms", default=None, metavar="DIR",
                   help="save each arm's model as DIR/ARM (transformers format), e.g. for genolong eval-recall")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.0f} s] {msg}", flush=True)

    lm = from_pretrained(args.model, dtype=torch.float32)
    if args.topk is not None:  # the same weights with another selection size
        sized = GenoLongForCausalLM(apply_overrides(lm.config, {"dsa": {"indexer": {"topk": args.topk}}}))
        sized.load_state_dict(lm.state_dict())
        lm = sized
    lm.to(args.device)
    hold_dsa_post(lm)  # as in its training (a no-op for a model trained with the post held at 1)
    if not indexer_layers(lm):
        raise SystemExit(f"{args.model} has no DSA layer with an indexer")
    gaps = [int(g) for g in args.gaps.split(",")]
    layout: dict = {}
    rows = []

    def evaluate(arm: str, selections=("indexer",)):
        if args.save_arms:
            save_pretrained(lm, Path(args.save_arms) / arm.replace("+", "_"))
        lm.eval()
        for gap in gaps:
            for selection in selections:
                row = {"arm": arm, **score(lm, args, gap, selection, layout)}
                rows.append(row)
                log(json.dumps(row))
        lm.train()

    evaluate("frozen", ("indexer", "oracle", "dense"))
    curves = {}
    if args.warmup_steps:  # (0: no warm-up arm; the frozen rows are the model as given)
        curves["warmup"] = train_indexer(lm, args, args.warmup_steps, "warmup", log)
        evaluate("warmup")
    if args.sparse_steps:
        curves["sparse"] = train_indexer(lm, args, args.sparse_steps, "sparse", log)
        evaluate("warmup+sparse" if args.warmup_steps else "sparse")
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "curves": curves, "wall_s": time.time() - t0}, indent=1) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
