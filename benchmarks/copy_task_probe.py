"""How many steps a small model needs before it can copy: a random L-mer of A/C/G/T followed by
the same L-mer, loss on the first half vs on the copy, every 20 steps.

    python benchmarks/copy_task_probe.py --model transformer --steps 800    # a dense 2-layer reference
    python benchmarks/copy_task_probe.py --model tiny --steps 800           # genolong's tiny preset
    python benchmarks/copy_task_probe.py --model tiny --overrides '{"hidden": 128, "dsa": {"num_heads": 4, "kv_lora_rank": 64}}' \
        --lr 3e-3 --steps 6000 --loss-on copy --max-gap 16 --save A          # the model of docs/recall.md's second CPU attempt
    python benchmarks/copy_task_probe.py --model tiny --overrides '...' --init-from A --steps 0 --max-gap 16 --eval-gaps 16,200,500

`--loss-on copy` trains on the copy's targets only; `--max-gap G` puts U[0, G] random bases between
the L-mer and its copy; `--eval-gaps` scores the copy in longer sequences with every key selected.
On real DNA (docs/recall.md, "On real DNA"): `--dna PREPARED` takes the rows from a prepared genome,
`--loss-on mix` trains on the copy and on the DNA around it, `--window W` puts the copy anywhere in a
W-base row, e.g.

    python benchmarks/copy_task_probe.py --model tiny --overrides '{"hidden": 128, "dsa": {"num_heads": 4, "kv_lora_rank": 64}}' \
        --init-from benchmarks/recall_cpu_indexer/gpu_dna/J1088 --dna data/bundled --loss-on mix --window 1088 --max-gap 960 \
        --hold-dsa-post --batch 16 --lr 1e-3 --steps 200 --save J2

The dense reference (hidden 64, 2 heads, learned positions, causal, pre-norm) is the yardstick for
the planted-repeat experiments' first stage (docs/recall.md): on 4 letters, copying needs a match
of several preceding bases, and small models sit on a plateau before they find it. Measured with
this script on the shared 2-core CPU machine (2026-12-01, L=64, batch 8, lr 1e-3, seed 0): the
transformer's copy loss stayed at ~2.0 bits to step ~320, was 1.60 at step 360, 0.54 at 400,
0.17 at 440 and ~0.07 from 520 on (203 s for 900 steps). The tiny preset, in an earlier variant
of this probe (loss over all 8 logits, AdamW betas 0.9/0.95), stayed at 2.0 bits through 370
steps at lr 3e-3 and through 360 at lr 1e-2 (~5 s per step on the loaded machine).
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class DenseReference(nn.Module):
    def __init__(self, max_len: int, hidden: int = 64, positions: bool = True) -> None:
        super().__init__()
        self.positions = positions
        self.emb = nn.Embedding(8, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        layer = nn.TransformerEncoderLayer(hidden, 2, 4 * hidden, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        x = self.emb(ids)
        if self.positions:  # without them (NoPE) the only position signal is the causal mask, as in genolong's MLA
            x = x + self.pos(torch.arange(t, device=ids.device))
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def copy_batch(batch: int, length: int, max_gap: int, layout: dict | None = None, source=None, window: int = 0):
    """Rows of [random prefix][L-mer][random gap][the L-mer again], 2L + G bases each, the gap
    U[0, G] and the prefix G - gap; with the masks (over the n - 1 next-base targets) of the
    first L-mer's predictable targets and of the copy's targets. `source(batch, n)` (copy_dna.DnaRows.rows)
    gives the rows instead of random bases: the L-mer and everything around it are then real DNA.
    `window` >= 2L + G: rows of `window` bases, each row's [L-mer][gap][copy] at a uniform offset, so the
    copy ends anywhere in the row, not always at its end (as in eval-recall's planted windows)."""
    n = max(2 * length + max_gap, window)
    ids = source(batch, n) if source is not None else torch.randint(0, 4, (batch, n))
    gap = torch.randint(0, max_gap + 1, (batch,))
    if window:
        start = (torch.rand(batch) * (n - 2 * length - gap + 1)).floor().long()  # of the first L-mer
    else:
        start = max_gap - gap  # the copy ends the row
    return (ids, *plant(ids, start, gap, length, layout))


def plant(ids: torch.Tensor, start, gap, length: int, layout: dict | None = None):
    """Writes each row's L-mer at `start` again `length + gap` later (in place); returns the masks, over
    the next-base targets, of the first L-mer's predictable targets and of the copy's targets."""
    copy_start = start + length + gap
    rows = torch.arange(ids.shape[0])[:, None]
    ids[rows, copy_start[:, None] + torch.arange(length)] = ids[rows, start[:, None] + torch.arange(length)]
    target = torch.arange(1, ids.shape[1])  # the base each target position predicts
    first = (target > start[:, None]) & (target < (start + length)[:, None])
    copy = (target >= copy_start[:, None]) & (target < (copy_start + length)[:, None])
    if layout is not None:  # where the L-mer and its copy start, per row (for --oracle-selection)
        layout.update(start=start, copy_start=copy_start, length=length)
    return first, copy


def oracle_topk(layout: dict):
    """A "dsa_indexer_topk" stand-in that always selects, for a query inside the copy, the pool holding
    the key it needs (the first occurrence of the base it predicts), and random other pools to fill
    the selection: a DSA layer learning to copy then searches a handful of keys, not the window."""

    def select(index_q, pool_keys, head_weights, *, kpool, topk_pools, always_select_tail, softmax_scale, query_offset=0):
        batch, seq = index_q.shape[:2]
        dev = index_q.device  # the layout is made on the CPU; the selection lives with the queries
        t = torch.arange(seq, device=dev)[None, :].expand(batch, seq) + query_offset
        visible = (t + 1) // kpool  # complete pools at or before each query
        start, copy_start = layout["start"][:, None].to(dev), layout["copy_start"][:, None].to(dev)
        inside = (t >= copy_start - 1) & (t < copy_start + layout["length"] - 1)
        needed = (t - (copy_start - start) + 1).clamp(min=0) // kpool
        pools = torch.floor(torch.rand(batch, seq, topk_pools, device=dev) * visible[..., None].clamp(min=1)).long()
        pools[..., 0] = torch.where(inside, needed, pools[..., 0])
        tokens = pools.unsqueeze(-1) * kpool + torch.arange(kpool, device=dev)
        keep = pools < visible[..., None]
        # a pool drawn twice is listed once
        same = (pools.unsqueeze(-1) == pools.unsqueeze(-2)).triu(1).any(-2)
        keep &= ~same
        tokens = torch.where(keep.unsqueeze(-1), tokens, -1).flatten(-2)
        width = topk_pools * kpool + (kpool - 1 if always_select_tail else 0)
        out = torch.full((batch, seq, width), -1, dtype=torch.int32, device=dev)
        out[..., : topk_pools * kpool] = tokens.int()
        if always_select_tail and kpool > 1:
            n_tail = (t + 1) % kpool
            lanes = torch.arange(kpool - 1, device=dev)
            tail = (t + 1 - n_tail)[..., None] + lanes
            out[..., topk_pools * kpool :] = torch.where(lanes < n_tail[..., None], tail, -1).int()
        return out

    return select


def hold_dsa_post(lm) -> None:
    """Every DSA layer's mHC post = 2 * sigmoid(post logits * scale[1] + base[n:2n]) held at exactly 1:
    its rows of `fn`, its `base` entries and scale[1] zeroed / set, their gradients masked to zero (the
    probe's AdamW has no weight decay, so they never move)."""
    for i, kind in enumerate(lm.config.layer_types):
        if kind != "dsa":
            continue
        hc = lm.model.layers[i].attn_hc
        n = hc.n
        with torch.no_grad():
            hc.fn[n : 2 * n].zero_()
            hc.base[n : 2 * n].zero_()
        rows = torch.zeros_like(hc.base, dtype=torch.bool)
        rows[n : 2 * n] = True
        hc.fn.register_hook(lambda g, rows=rows: g.masked_fill(rows.to(g.device)[:, None], 0.0))
        hc.base.register_hook(lambda g, rows=rows: g.masked_fill(rows.to(g.device), 0.0))
        # scale[1] multiplies the (now zero) post logits only: its gradient is zero already.


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("transformer", "tiny", "preset"), default="transformer")
    p.add_argument("--preset", default="tiny", help="with --model preset: which genolong preset")
    p.add_argument("--overrides", default="{}",
                   help='JSON for get_preset (tiny / preset), e.g. \'{"hidden": 128}\'; the indexer top-k is raised to cover '
                   "the whole sequence unless given, so that the DSA layers are dense and can see the first half")
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-positions", action="store_true", help="transformer: no learned positions (NoPE)")
    p.add_argument("--loss-on", choices=("all", "copy", "mix"), default="all",
                   help="copy: train on the copy's targets only (the first half is random: its loss is noise); mix: the "
                   "mean loss on the copy plus the mean loss on every other target (with --dna: DNA modelling and copying, "
                   "neither drowned by the other)")
    p.add_argument("--dna", default=None, metavar="PREPARED",
                   help="rows from this `genolong prepare` output (N-free windows, both strands) instead of random bases")
    p.add_argument("--dna-split", default="train", help="with --dna: the split the rows come from")
    p.add_argument("--window", type=int, default=0,
                   help="rows of this many bases (>= 2L + G) with the L-mer, gap and copy at a random offset in each: the "
                   "copy no longer always ends the row (0: rows of 2L + G bases, the copy at the end)")
    p.add_argument("--max-gap", type=int, default=0,
                   help="random bases between the L-mer and its copy: U[0, G] of them (the rest before the L-mer), so the "
                   "copy's distance varies from L to L + G; 0: the copy follows at once (distance L)")
    p.add_argument("--init-from", default=None,
                   help="tiny / preset: start from this model's weights (a saved probe model; the same architecture, e.g. "
                   "the same --overrides, while the indexer top-k follows this run's length)")
    p.add_argument("--eval-gaps", default="",
                   help="tiny / preset, after training (--steps 0: only this): the copy loss of 64 sequences at each of these "
                   "--max-gap values (comma-separated), with a selection that holds every key (does the copying transfer to "
                   "longer windows?)")
    p.add_argument("--hold-dsa-post", action="store_true",
                   help="tiny / preset: set every DSA layer's mHC post weights to exactly 1 (its output added to every "
                   "stream) and keep them there (their gradients zeroed): in the copy probes of 2026-12-02 those gates "
                   "closed (2 * sigmoid -> 0) early in training, switching the sparse attention off for good")
    p.add_argument("--oracle-selection", action="store_true",
                   help="tiny / preset: replace the indexer's top-k by one that always holds the pool a copy query needs "
                   "(plus random pools); give the model a sparse top-k in --overrides")
    p.add_argument("--save", default=None, help="tiny / preset: save the model here (transformers format) at every print")
    p.add_argument("--every", type=int, default=20, help="print every this many steps")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop after this many seconds of training (the model saved and the curve written at the step "
                   "where it stopped; the JSON records steps_done and stopped_for_time)")
    p.add_argument("--out", default=None,
                   help="write the curve (step, first-half bits, copy bits, seconds, bits outside the copy) as JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    if args.model in ("tiny", "preset"):
        from genolong.model import GenoLongForCausalLM, get_preset

        overrides = json.loads(args.overrides)
        dsa = overrides.setdefault("dsa", {})
        dsa.setdefault("indexer", {}).setdefault("topk", 4 * ((max(2 * args.length + args.max_gap, args.window) + 3) // 4))
        lm = GenoLongForCausalLM(get_preset("tiny" if args.model == "tiny" else args.preset, **overrides))
        if args.init_from:
            from genolong.model import from_pretrained

            lm.load_state_dict(from_pretrained(args.init_from, dtype=torch.float32).state_dict())
        if args.hold_dsa_post:
            hold_dsa_post(lm)
        lm = lm.to(dev)

        def model(ids):
            return lm(ids).logits
    else:
        lm = DenseReference(max(2 * args.length + args.max_gap, args.window), positions=not args.no_positions).to(dev)
        model = lm
    opt = torch.optim.AdamW(lm.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    L, G, t0, curve = args.length, args.max_gap, time.time(), []
    layout: dict = {}
    if args.oracle_selection:
        from genolong.model import ops

        ops.register("dsa_indexer_topk", ops.REFERENCE, oracle_topk(layout))
    positions = torch.arange(max(2 * L + G, args.window) - 1, device=dev)
    source = None
    if args.dna:
        from copy_dna import DnaRows

        source = DnaRows(args.dna, args.dna_split, seed=args.seed).rows
    stopped_for_time, steps_done = False, 0
    for step in range(args.steps):
        ids, first_mask, copy_mask = copy_batch(args.batch, L, G, layout, source, args.window)
        ids, first_mask, copy_mask = ids.to(dev), first_mask.to(dev), copy_mask.to(dev)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits[..., :4].float().reshape(-1, 4), ids[:, 1:].reshape(-1), reduction="none").view(args.batch, -1)
        opt.zero_grad()
        if args.loss_on == "copy":
            objective = loss[copy_mask].mean()
        elif args.loss_on == "mix":
            objective = loss[copy_mask].mean() + loss[~copy_mask].mean()
        else:
            objective = loss.mean()
        objective.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        steps_done = step + 1
        stopped_for_time = args.budget_s is not None and time.time() - t0 > args.budget_s and step < args.steps - 1
        if step % args.every == 0 or step == args.steps - 1 or stopped_for_time:
            first = loss[first_mask].mean().item() / math.log(2)
            # after the first 8 bases of the copy (its start cannot be predicted)
            late = copy_mask & (positions >= copy_mask.float().argmax(1, keepdim=True) + 8)
            copy = loss[late].mean().item() / math.log(2)
            rest = loss[~copy_mask].mean().item() / math.log(2)  # every target outside the copy (DNA with --dna)
            curve.append((step, round(first, 4), round(copy, 4), round(time.time() - t0, 1), round(rest, 4)))
            print(f"step {step:5d}  first half {first:.3f} bits  copy {copy:.3f} bits  outside the copy {rest:.3f} bits  "
                  f"{time.time() - t0:.0f} s", flush=True)
            if args.save and args.model in ("tiny", "preset"):
                from genolong.model import save_pretrained

                save_pretrained(lm, args.save)
            write_record(args, curve, steps_done, stopped_for_time)
        if stopped_for_time:
            print(f"stopped for time after {steps_done} steps", flush=True)
            break
    if args.eval_gaps and args.model in ("tiny", "preset"):
        transfer = evaluate_gaps(lm, args, overrides, [int(g) for g in args.eval_gaps.split(",")], dev)
        write_record(args, curve, steps_done, stopped_for_time, transfer=transfer)


def write_record(args, curve, steps_done: int, stopped_for_time: bool, **more) -> None:
    if args.out:
        record = {"args": vars(args), "curve": curve, "steps_done": steps_done, "stopped_for_time": stopped_for_time, **more}
        Path(args.out).write_text(json.dumps(record) + "\n")


def evaluate_gaps(lm, args, overrides: dict, gaps: list[int], dev) -> list[dict]:
    """Copy bits (after the copy's first 8 bases) at each max gap, the model's weights in a model whose
    indexer top-k covers the whole sequence (the DSA layers dense), 8 batches of 8 sequences."""
    from genolong.model import GenoLongForCausalLM, get_preset

    rows = []
    for gap in gaps:
        n = 2 * args.length + gap
        changed = json.loads(json.dumps(overrides))
        changed.setdefault("dsa", {}).setdefault("indexer", {})["topk"] = 4 * ((n + 3) // 4)
        dense = GenoLongForCausalLM(get_preset("tiny" if args.model == "tiny" else args.preset, **changed)).to(dev)
        dense.load_state_dict(lm.state_dict())
        dense.eval()
        total, count = 0.0, 0
        positions = torch.arange(n - 1, device=dev)
        source = None
        if args.dna:
            from copy_dna import DnaRows

            source = DnaRows(args.dna, "holdout", seed=10_000 + gap).rows
        for _ in range(8):
            ids, _first, copy = copy_batch(8, args.length, gap, source=source)
            ids, copy = ids.to(dev), copy.to(dev)
            with torch.no_grad():
                logits = dense(ids[:, :-1]).logits
            loss = F.cross_entropy(logits[..., :4].float().reshape(-1, 4), ids[:, 1:].reshape(-1), reduction="none").view(8, -1)
            late = copy & (positions >= copy.float().argmax(1, keepdim=True) + 8)
            total += float(loss[late].sum()) / math.log(2)
            count += int(late.sum())
        rows.append({"max_gap": gap, "tokens": n, "copy_bits": round(total / count, 4)})
        print(f"copy at max gap {gap} ({n} tokens, dense selection): {total / count:.3f} bits", flush=True)
    return rows


if __name__ == "__main__":
    main()
