"""Expert loads of a model trained from scratch on real DNA on the CPU, step by step (docs/training.md,
"Expert balance"): does the bias rule undo the early collapse, and why does the routing collapse?

    python -m genolong prepare --fasta bundled --out /tmp/bundled
    python benchmarks/router_balance_cpu.py --data /tmp/bundled --preset tiny --steps 400 --lr 2e-3 --warmup 10 --rate 1e-2
    python benchmarks/router_balance_cpu.py --data /tmp/bundled --preset glm53-mini --layers 4 --seq 128 --steps 240 --rate 1e-2
    python benchmarks/router_balance_cpu.py ... --router-lr 0.01     # the routers at 1/100 of the learning rate

One torch thread; `--batch` windows of `--seq` bases from the train split per step, AdamW (genolong's
MasterAdamW, clip 1.0, warmup + cosine), genolong's ExpertBalancer at `--rate` (and `--aux`). Prints
loss, gradient norm and every MoE layer's busiest expert / mean every `--every` steps; at the end,
for the last MoE layer on the last batch, how alike the router's inputs are (mean cosine to their
common direction) and how much its logits differ between tokens vs between experts.
"""

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from genolong.data import WindowSampler, open_prepared
from genolong.model import GenoLongForCausalLM, get_preset
from genolong.model.moe import Router
from genolong.train.balance import ExpertBalancer
from genolong.train.host_allocator import keep_freed_host_memory
from genolong.train.loss import full_lm_loss
from genolong.train.optim import MasterAdamW, clip_scale, lr_at
from genolong.vocab import N_ID


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a prepared genome")
    ap.add_argument("--preset", default="glm53-mini")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rate", type=float, default=1e-3, help="--balance-rate")
    ap.add_argument("--aux", type=float, default=0.0, help="--aux-loss-coeff")
    ap.add_argument("--router-lr", type=float, default=1.0, help="the routers' learning rate as a multiple of --lr")
    ap.add_argument("--every", type=int, default=1)
    a = ap.parse_args()
    keep_freed_host_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GenoLongForCausalLM(get_preset(a.preset, num_layers=a.layers))
    windows = iter(WindowSampler(open_prepared(a.data), "train", a.seq + 1, seed=0))
    opt = MasterAdamW(list(model.named_parameters()), lr=a.lr)
    balancer = ExpertBalancer(model, rate=a.rate, aux_loss_coeff=a.aux)
    routers = [n for n in opt.params if n.endswith("gate.weight")]
    rest = [n for n in opt.params if n not in routers]
    for step in range(a.steps):
        ids = torch.from_numpy(np.stack([next(windows).tokens for _ in range(a.batch)]).astype(np.int64))
        inputs, targets = ids[:, :-1], ids[:, 1:]
        valid = targets != N_ID
        balancer.begin_step(a.batch * a.seq, a.seq)
        loss = full_lm_loss(model.hidden_states(inputs), model.lm_head.weight, targets, valid, global_valid_count=int(valid.sum()))
        loss.backward()
        norm = opt.grad_norm()
        lr = lr_at(step, a.lr, a.warmup, a.steps, 0.1)
        if a.router_lr != 1.0:
            opt.step(lr, clip_scale(norm, 1.0), only=rest)
            opt.step_count -= 1  # one optimizer step, in two calls
            opt.step(lr * a.router_lr, clip_scale(norm, 1.0), only=routers)
        else:
            opt.step(lr, clip_scale(norm, 1.0))
        opt.zero_grad()
        stats = balancer.finish_step()
        if step < 3 or (step + 1) % a.every == 0:
            loads = " ".join(f"{v:.2f}" for v in stats.load_max.values())
            print(f"step {step + 1:4d}  loss {loss.item():.3f}  grad norm {norm:7.2f}  busiest/mean {loads}", flush=True)
    router = [m for m in model.modules() if isinstance(m, Router)][-1]
    seen = {}
    handle = router.register_forward_hook(lambda _m, args, _o: seen.update(x=args[0].detach()))
    with torch.no_grad():
        model.hidden_states(inputs)
    handle.remove()
    x = seen["x"].float()
    unit = F.normalize(x, dim=-1)
    common = F.normalize(unit.mean(0), dim=0)
    logits = x @ router.weight.detach().float().t()
    print(f"router input: mean cosine to the common direction {float((unit @ common).mean()):.4f}; logits' std between "
          f"tokens {float(logits.std(0).mean()):.4f}, between experts (of their means) {float(logits.mean(0).std()):.4f}; "
          f"bias range [{float(router.e_score_correction_bias.min()):+.3f}, {float(router.e_score_correction_bias.max()):+.3f}]")


if __name__ == "__main__":
    main()
