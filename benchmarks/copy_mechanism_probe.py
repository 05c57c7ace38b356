"""Which layers of a model copy? The copy task's loss at several gaps with every DSA layer dense,
with every DSA layer's attention output removed, and with every KDA layer's removed.

    python benchmarks/copy_mechanism_probe.py --model A --gaps 16,64,128,256,384 --out copy_mechanism.json

The model is a saved copy probe model (benchmarks/copy_task_probe.py --save) or any genolong model
directory. "Removed" zeroes that mixer's o_proj for the measurement (the residual streams go on
without it). A model whose copy loss does not change when the DSA layers are removed does not
copy through its sparse attention, so nothing its indexer selects matters to the copy
(docs/recall.md, "CPU, third attempt").
"""

import argparse
import copy
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from copy_task_probe import copy_batch
from genolong.model import GenoLongForCausalLM, from_pretrained
from genolong.model.presets import apply_overrides


def copy_bits(model, length: int, gap: int, batches: int, seed: int) -> float:
    """Copy bits after the copy's first 8 bases, `batches` x 8 sequences of the probe's task."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    total, count = 0.0, 0
    positions = torch.arange(2 * length + gap - 1)
    for _ in range(batches):
        ids, _first, copy_mask = copy_batch(8, length, gap)
        with torch.no_grad():
            logits = model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits[..., :4].float().reshape(-1, 4), ids[:, 1:].reshape(-1), reduction="none").view(8, -1)
        late = copy_mask & (positions >= copy_mask.float().argmax(1, keepdim=True) + 8)
        total += float(loss[late].sum()) / math.log(2)
        count += int(late.sum())
    torch.random.set_rng_state(gen_state)
    return total / count


def without(model, layer_type: str):
    """A copy of `model` whose `layer_type` mixers ("kda" / "dsa") add nothing to the streams."""
    cut = copy.deepcopy(model)
    for i, kind in enumerate(cut.config.layer_types):
        if kind == layer_type:
            cut.model.layers[i].self_attn.o_proj.weight.data.zero_()
            if cut.model.layers[i].self_attn.o_proj.bias is not None:
                cut.model.layers[i].self_attn.o_proj.bias.data.zero_()
    return cut


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--gaps", default="16,64,128,256,384")
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    saved = from_pretrained(args.model, dtype=torch.float32)
    rows = []
    for gap in (int(g) for g in args.gaps.split(",")):
        n = 2 * args.length + gap
        dense = GenoLongForCausalLM(apply_overrides(saved.config, {"dsa": {"indexer": {"topk": 4 * ((n + 3) // 4)}}}))
        dense.load_state_dict(saved.state_dict())
        dense.eval()
        row = {"gap": gap, "distance": f"{args.length}-{args.length + gap}", "tokens": n}
        for name, model in (("dense", dense), ("no_dsa", without(dense, "dsa")), ("no_kda", without(dense, "kda"))):
            row[f"copy_bits_{name}"] = round(copy_bits(model, args.length, gap, args.batches, args.seed), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
