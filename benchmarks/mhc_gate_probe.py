"""Is a layer's output still reaching the model? Per layer, the mean mHC post weight (2 * sigmoid:
1 at initialisation, 0 = the sublayer's output is dropped) and how much the logits change when
that layer's mixer output is removed, on windows of real DNA.

    python benchmarks/mhc_gate_probe.py --data data/bundled --seq 512 RUN/checkpoints/step-* A_MODEL_DIR

For models trained from scratch with genolong's DNA vocabulary (prepared ids are model ids).
Found with it (2026-12-02, docs/recall.md "CPU, third attempt"): in every copy-probe model the
DSA layer's post weights had gone to 0.000, its removal changing the logits by < 1e-3 -- the
sparse attention was switched off, so what the indexer selects could not matter.
"""

import argparse
import copy
import json
from pathlib import Path

import torch
from datasets import load_from_disk

from genolong.model import from_pretrained
from genolong.train import checkpoint as ckpt_io


def windows(data: Path, split: str, seq: int, count: int) -> torch.Tensor:
    record = load_from_disk(str(data))[split][0]
    tokens = torch.frombuffer(bytearray(record["tokens"]), dtype=torch.uint8).long()
    if tokens.numel() < seq * count:
        raise SystemExit(f"{split} holds {tokens.numel():,} bases: fewer than {count} windows of {seq}")
    return tokens[: seq * count].view(count, seq)


def probe(model, ids: torch.Tensor) -> list[dict]:
    posts = {}
    hooks = [layer.attn_hc.register_forward_hook(lambda mod, i, o, k=k: posts.__setitem__(k, o[0].mean().item()))
             for k, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        base = model(ids).logits.float()
    for h in hooks:
        h.remove()
    rows = []
    for k, kind in enumerate(model.config.layer_types):
        cut = copy.deepcopy(model)
        cut.model.layers[k].self_attn.o_proj.weight.data.zero_()
        with torch.no_grad():
            change = (cut(ids).logits.float() - base).abs().max().item()
        rows.append({"layer": k, "type": kind, "post_mean": round(posts[k], 4), "logit_change_without_it": round(change, 5)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="model directories, run checkpoints or finetune runs (their latest checkpoint)")
    p.add_argument("--data", required=True)
    p.add_argument("--split", default="holdout")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    ids = windows(Path(args.data), args.split, args.seq, args.windows)
    report = {}
    for path in args.models:
        model_dir = Path(path)
        if (model_dir / ckpt_io.CHECKPOINTS).is_dir():  # a finetune run: its latest checkpoint
            model_dir = ckpt_io.latest(model_dir)
        if (model_dir / ckpt_io.MODEL_DIR / "config.json").exists():
            model_dir = model_dir / ckpt_io.MODEL_DIR
        rows = probe(from_pretrained(model_dir, dtype=torch.float32).eval(), ids)
        report[path] = rows
        print(path, " ".join(f"L{r['layer']}:{r['type']} post {r['post_mean']:.3f} dlogit {r['logit_change_without_it']:.4f}" for r in rows), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "models": report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
