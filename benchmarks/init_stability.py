"""Where a freshly initialised glm53-mini's first gradient goes, and whether it trains at a high lr.

For each initialisation variant (`--variants`; `genolong`: the project's init, LM head
normal(0, 1/hidden); `reference`: the LM head normal(0, 0.02) as transformers' glm5_next;
`zero`: a zero head; `reference+mhc_scale`: also the mHC gating scales at 0.01 (the mHC paper's
alpha init); `reference+embedding_std_1`: also a unit-scale embedding), on windows of the bundled
E. coli genome (the same windows for every variant):
1. the first step's gradient norm, total and per parameter group (layer index folded), measured
   with a hook per parameter so that no gradient is kept (45 layers fit in ~5 GiB of host memory);
2. with `--steps N`, N AdamW steps (clip 1.0) at `--lr` with `--warmup`, and the loss and
   gradient norm per step; a spike is a loss above 1.5x the running minimum after warmup.

    python benchmarks/init_stability.py --data /tmp/bundled --layers 45 --seq 256 --topk 256   # (1) only
    python benchmarks/init_stability.py --data /tmp/bundled --layers 8 --seq 256 --batch 2 --topk 64 \
        --steps 12 --lr 1e-3 --warmup 2 --variants reference,reference+mhc_scale,reference+embedding_std_1,zero,genolong

Prepare the data with `python -m genolong prepare --fasta bundled --out /tmp/bundled`. On CPU the
hot ops run their PyTorch references (about a second per layer and step at 512 tokens). `--topk`
shrinks the indexer's top-k: at a sequence no longer than it, DSA is dense causal attention either
way (identical results), and the reference sparse attention's gather, which is sized by the top-k,
stays small (45 layers at the preset's 2048 need ~17 GB of host memory at 256 tokens).
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections import defaultdict

import numpy as np
import torch

from genolong.data import WindowSampler, open_prepared
from genolong.model import GenoLongForCausalLM, get_preset
from genolong.train.loss import chunked_lm_loss
from genolong.train.optim import MasterAdamW, clip_scale, lr_at
from genolong.vocab import N_ID

SPIKE = 1.5


def _reference_head(model):
    model.lm_head.weight.normal_(0.0, 0.02)


def _zero_head(model):
    model.lm_head.weight.zero_()


def _mhc_scale(model):
    from genolong.model.mhc import HyperConnection

    for module in model.modules():
        if isinstance(module, HyperConnection):
            module.scale.fill_(0.01)


def _embedding_std_1(model):
    model.model.embed_tokens.weight.normal_(0.0, 1.0)


CHANGES = {
    "genolong": [],
    "reference": [_reference_head],
    "zero": [_zero_head],
    "reference+mhc_scale": [_reference_head, _mhc_scale],
    "reference+embedding_std_1": [_reference_head, _embedding_std_1],
}


def build(layers: int, variant: str, seed: int, topk: int | None) -> GenoLongForCausalLM:
    overrides = {"dsa": {"indexer": {"topk": topk}}} if topk else {}
    torch.manual_seed(seed)
    model = GenoLongForCausalLM(get_preset("glm53-mini", num_layers=layers, **overrides))
    with torch.no_grad():
        for change in CHANGES[variant]:
            change(model)
    return model


def windows(data: str, seq: int, batch: int, seed: int):
    sampler = iter(WindowSampler(open_prepared(data), "train", seq + 1, seed=seed))
    while True:
        tokens = torch.from_numpy(np.stack([next(sampler).tokens for _ in range(batch)]).astype(np.int64))
        yield tokens[:, :-1], tokens[:, 1:]


def loss_of(model, inputs, targets):
    return chunked_lm_loss(model.hidden_states(inputs), model.lm_head.weight, targets, targets != N_ID, 1 << 16)


def group_of(name: str) -> str:
    return re.sub(r"\.(weight)$", "", re.sub(r"layers\.\d+\.", "layers.*.", name))


def first_gradient(model, inputs, targets) -> tuple[float, float, dict[str, float]]:
    """(loss, total norm, {group: norm}); each gradient is reduced to its square norm and dropped."""
    squares: dict[str, float] = defaultdict(float)

    def take(name):
        def hook(p):
            squares[group_of(name)] += float(p.grad.float().square().sum())
            p.grad = None

        return hook

    handles = [p.register_post_accumulate_grad_hook(take(n)) for n, p in model.named_parameters() if p.requires_grad]
    loss = loss_of(model, inputs, targets)
    loss.backward()
    for h in handles:
        h.remove()
    return float(loss.detach()), math.sqrt(sum(squares.values())), {g: math.sqrt(v) for g, v in squares.items()}


def train(model, batches, steps: int, lr: float, warmup: int) -> list[tuple[float, float]]:
    opt = MasterAdamW(list(model.named_parameters()), lr=lr)
    out = []
    for step in range(steps):
        inputs, targets = next(batches)
        loss = loss_of(model, inputs, targets)
        loss.backward()
        norm = opt.grad_norm()
        opt.step(lr_at(step, lr, warmup, steps, 0.1), clip_scale(norm, 1.0))
        opt.zero_grad()
        out.append((float(loss.detach()), norm))
        print(f"    step {step + 1:3d}  loss {out[-1][0]:.4f}  grad norm {norm:8.2f}", flush=True)
    return out


def spikes(losses: list[float]) -> list[int]:
    """1-based steps whose loss exceeds SPIKE x the lowest loss before them (warmup included)."""
    found, best = [], math.inf
    for i, loss in enumerate(losses):
        if loss > SPIKE * best:
            found.append(i + 1)
        best = min(best, loss)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--layers", type=int, default=45)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--topk", type=int, default=None, help="indexer top-k override (CPU speed; default the preset's 2048)")
    ap.add_argument("--groups", type=int, default=12, help="parameter groups to list")
    ap.add_argument("--variants", default="reference,genolong", help=", ".join(CHANGES))
    args = ap.parse_args()
    torch.set_num_threads(1)

    for head in args.variants.split(","):
        model = build(args.layers, head, args.seed, args.topk)
        batches = windows(args.data, args.seq, args.batch, args.seed)
        inputs, targets = next(batches)
        t0, c0 = time.perf_counter(), time.process_time()
        loss, total, groups = first_gradient(model, inputs, targets)
        print(f"\n{head} (LM head std {model.lm_head.weight.std():.5f}), glm53-mini {args.layers} layers, {args.batch}x{args.seq} tokens")
        print(f"  first loss {loss:.4f}, first gradient norm {total:.2f}  ({time.perf_counter() - t0:.0f} s wall, {time.process_time() - c0:.0f} s CPU)")
        for group, norm in sorted(groups.items(), key=lambda kv: -kv[1])[: args.groups]:
            print(f"  {norm:10.3f}  {group}")
        if args.steps:
            model.zero_grad(set_to_none=True)
            result = train(model, windows(args.data, args.seq, args.batch, args.seed), args.steps, args.lr, args.warmup)
            losses = [x for x, _ in result]
            found = spikes(losses)
            tail = sum(losses[-4:]) / len(losses[-4:])
            print(f"  {head}: spikes at steps {found or 'none'}; mean of the last 4 losses {tail:.4f} (uniform ACGT: {math.log(4):.4f})")
        del model


if __name__ == "__main__":
    main()
