"""tp=2 and ep=2 against cp=2 on glm53-mini layers: correctness first, then step time and memory per GPU.

    source .device/activate.sh && torchrun --standalone --nproc_per_node=2 benchmarks/bench_tp_ep.py \
        --out $OUT/tp_ep --lengths 128k,512k --layers 8 --budget-s 420

For each layout (`--layouts`, default tp=2,ep=2,cp=2; a layout whose world size differs from
the processes started is recorded as not run; cp=2 needs genolong.parallel.context):
1. check: per-token losses of a `--check-seq` step at the layout against the plain model on rank
   0 (same weights, same sequences), bf16; a relative RMSE over 2e-2 marks the layout FAILED
   and it is not timed;
2. steps at each of `--lengths`: forward, backward and the gradient sums over their groups
   (genolong.parallel.tensor_grads.reduce_gradients), with full-layer recompute and MoE
   chunking; the first step of a length (kernel compilation, autotuning) is left out. Reported:
   step seconds (the slowest rank), tokens/s per GPU, peak GPU memory (the largest rank), the
   busiest ep rank's rows over the mean (ep), and the hot-op audit (which kernel every layer ran).

Every rank writes its full log to OUT/rank<r>.log; rank 0 writes OUT/results.jsonl (one line per
measurement, appended as it goes) and OUT/table.txt. Layouts and lengths are skipped, and
recorded as skipped, once --budget-s is spent (a length already started finishes). Estimated, not measured (the
45-layer H200 steps of docs/performance.md scaled to 8 layers: ~3 s at 128k, ~15-20 s at 512k per layout, plus first-step
compilation): ~6 minutes on two H200s with the defaults.

On one process (`torchrun --nproc_per_node=1` or plain python) the layout "1" times the plain
model (the single-GPU baseline at the same lengths). CPU smoke test (gloo, tiny preset):
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_tp_ep.py --device cpu --preset tiny \
        --layers 4 --lengths 512 --check-seq 256 --out /tmp/tp_ep
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from genolong.model import get_preset, ops
from genolong.model.model import GenoLongForCausalLM
from genolong.parallel.layout import ParallelLayout, check_layout, parse_layout
from genolong.units import format_length, parse_length

CHECK_TOLERANCE = 2e-2


class Log:
    def __init__(self, out: Path, rank: int) -> None:
        self.rank = rank
        self.file = open(out / f"rank{rank}.log", "a")  # noqa: SIM115 (kept open for the run)
        self.results = out / "results.jsonl"

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        self.file.write(line + "\n")
        self.file.flush()
        if self.rank == 0:
            print(line, flush=True)

    def result(self, record: dict) -> None:
        self(json.dumps(record))
        if self.rank == 0:
            with open(self.results, "a") as f:
                f.write(json.dumps(record) + "\n")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def _max_over_ranks(value: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def build_model(args, device: torch.device) -> GenoLongForCausalLM:
    torch.manual_seed(0)
    config = get_preset(args.preset, num_layers=args.layers)
    with torch.device(device):
        model = GenoLongForCausalLM(config, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return model


def tokens(args, n: int, seq: int, device: torch.device, seed: int) -> torch.Tensor:
    """n windows of seq + 1 ids: real DNA from --data, or uniform random bases."""
    if args.data:
        from genolong.data import WindowSampler, open_prepared

        sampler = WindowSampler(open_prepared(args.data), "train", seq + 1, seed=seed, max_n_fraction=0.1)
        rows = [sampler.window(k).tokens.astype(np.int64) for k in range(n)]
    else:
        rng = np.random.default_rng(seed)
        rows = [rng.integers(0, 4, seq + 1, dtype=np.int64) for _ in range(n)]
    return torch.from_numpy(np.stack(rows)).to(device)


def parallelize(model, layout: ParallelLayout, device: torch.device):
    """The layout's passes on `model`; returns the mesh (None for one process)."""
    if layout.is_single:
        return None
    from genolong.parallel.expert import apply_expert_parallel
    from genolong.parallel.mesh import build_mesh
    from genolong.parallel.tensor import apply_tensor_parallel

    pmesh = build_mesh(layout, device.type)
    apply_tensor_parallel(model, pmesh)
    apply_expert_parallel(model, pmesh)
    if layout.cp > 1:
        from genolong.parallel.context import apply_context_parallel  # ImportError: the CP wrappers are not merged

        apply_context_parallel(model, pmesh)
    return pmesh


def my_rows_and_columns(window: torch.Tensor, pmesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (ids, targets): its replica's sequences, its cp shard (tp ranks read the same)."""
    ids, targets = window[:, :-1], window[:, 1:]
    if pmesh is None:
        return ids, targets
    replicas, cp = pmesh.size("batch"), pmesh.size("cp")
    rows = slice(pmesh.rank("batch") * ids.shape[0] // replicas, (pmesh.rank("batch") + 1) * ids.shape[0] // replicas)
    part = ids.shape[1] // cp
    cols = slice(pmesh.rank("cp") * part, (pmesh.rank("cp") + 1) * part)
    return ids[rows, cols], targets[rows, cols]


def per_token_loss(model, ids, targets) -> torch.Tensor:
    logits = model(ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


def gather_losses(losses: torch.Tensor, pmesh) -> torch.Tensor | None:
    """The whole batch's per-token losses on rank 0 (replicas x cp shards; tp ranks hold copies)."""
    if pmesh is None:
        return losses
    every = [torch.empty_like(losses) for _ in range(dist.get_world_size())]
    dist.all_gather(every, losses.contiguous())
    if dist.get_rank() != 0:
        return None
    coords = pmesh.mesh.mesh.flatten().tolist()  # rank -> position in (dp, ep, cp, tp) order
    sizes = [pmesh.size(d) for d in ("dp", "ep", "cp", "tp")]
    by_replica: dict[int, dict[int, torch.Tensor]] = {}
    for index, rank in enumerate(coords):
        dp, ep, cp, tp = np.unravel_index(index, sizes)
        if tp == 0:
            by_replica.setdefault(int(dp * sizes[1] + ep), {})[int(cp)] = every[rank]
    return torch.cat([torch.cat([shards[c] for c in sorted(shards)], 1) for _, shards in sorted(by_replica.items())], 0)


def check(args, layout, device, log) -> dict:
    from genolong.parallel.tensor_grads import reduce_gradients

    seq = parse_length(args.check_seq)
    window = tokens(args, layout.data_parallel, seq, device, seed=7)
    reference = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        plain = build_model(args, device)
        reference = per_token_loss(plain, window[:, :-1], window[:, 1:]).detach()
        del plain
    model = build_model(args, device)
    pmesh = parallelize(model, layout, device)
    ids, targets = my_rows_and_columns(window, pmesh)
    losses = per_token_loss(model, ids, targets)
    losses.sum().backward()
    if pmesh is not None:
        reduce_gradients(model, pmesh)
    whole = gather_losses(losses.detach(), pmesh)
    record = {"phase": "check", "layout": str(layout), "seq": seq}
    if whole is not None:
        err = float((whole - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt())
        record.update(rel_rmse=err, ok=err <= CHECK_TOLERANCE)
    ok = torch.tensor([float(record.get("ok", True))], device=device)
    if dist.is_initialized():
        dist.broadcast(ok, 0)
    record["ok"] = bool(ok.item())
    return record


def time_length(args, layout, seq: int, device, log) -> dict:
    from genolong.parallel.expert import dispatch_imbalance
    from genolong.parallel.tensor_grads import reduce_gradients
    from genolong.train.memory import apply_memory_optimizations
    from genolong.train.options import MemoryOptions

    model = build_model(args, device)
    pmesh = parallelize(model, layout, device)
    apply_memory_optimizations(model, MemoryOptions(recompute=True, offload=False, moe_chunking=True, chunked_loss=False))
    window = tokens(args, layout.data_parallel, seq, device, seed=11)
    ids, targets = my_rows_and_columns(window, pmesh)
    times, peaks = [], []
    for step in range(args.steps + 1):
        ops.reset_audit()
        model.zero_grad(set_to_none=True)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        losses = per_token_loss(model, ids, targets)
        (losses.sum() / losses.numel()).backward()
        if pmesh is not None:
            reduce_gradients(model, pmesh)
        _sync(device)
        elapsed = _max_over_ranks(time.perf_counter() - t0, device)
        peak = _max_over_ranks(torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0, device)
        log(f"  {layout} {format_length(seq)} step {step}: {elapsed:.3f} s, peak {peak:.2f} GiB{' (first step, left out)' if step == 0 else ''}")
        if step > 0:
            times.append(elapsed)
            peaks.append(peak)
    world = dist.get_world_size() if dist.is_initialized() else 1
    # Tokens entering the step once: every replica's sequences (tp and cp ranks share theirs).
    step_tokens = layout.data_parallel * seq
    best = min(times)
    return {
        "phase": "time", "layout": str(layout), "seq": seq, "layers": args.layers, "step_s": best,
        "tokens_per_s_per_gpu": step_tokens / best / world, "peak_gib": max(peaks),
        "ep_imbalance": dispatch_imbalance(model, pmesh) if pmesh is not None and layout.ep > 1 else None,
        "audit": ops.audit_summary(),
    }


def table(records: list[dict]) -> str:
    lines = ["| layout | length | step s | tokens/s per GPU | peak GiB per GPU | busiest ep rank / mean |", "|---|---|---|---|---|---|"]
    for r in records:
        if r.get("phase") != "time":
            continue
        imb = "" if not r.get("ep_imbalance") else f"{max(r['ep_imbalance'].values()):.2f}"
        lines.append(f"| {r['layout']} | {format_length(r['seq'])} | {r['step_s']:.3f} | {r['tokens_per_s_per_gpu']:,.0f} | {r['peak_gib']:.2f} | {imb} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="glm53-mini")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (8: two DSA layers, five MoE layers)")
    p.add_argument("--layouts", default="tp=2;ep=2;cp=2", help="';'-separated --parallel values ('1': one process)")
    p.add_argument("--lengths", default="128k,512k")
    p.add_argument("--check-seq", default="8k")
    p.add_argument("--steps", type=int, default=2, help="timed steps per length (after one left-out first step)")
    p.add_argument("--data", default=None, help="a prepared genome (genolong prepare); default uniform random bases")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernels", default="auto", help="hot-op policy: fused, auto or reference")
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    start = time.perf_counter()
    device_type = args.device
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        from genolong.parallel.mesh import init_distributed

        init_distributed(device_type)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if device_type == "cuda" else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out, rank)
    import genolong.kernels

    genolong.kernels.load()
    ops.use(args.kernels if device.type == "cuda" else "reference")
    log(f"bench_tp_ep: world {world}, {device}, preset {args.preset} x {args.layers} layers, kernels {ops.current_policy()}, torch {torch.__version__}")

    records: list[dict] = []
    config = get_preset(args.preset, num_layers=args.layers)
    lengths = [parse_length(x) for x in args.lengths.split(",") if x.strip()]
    for text in [t.strip() for t in args.layouts.split(";") if t.strip()]:
        layout = parse_layout(None if text == "1" else text)
        if layout.world_size != world:
            records.append({"phase": "skip", "layout": str(layout), "why": f"needs {layout.world_size} processes, {world} started"})
            log.result(records[-1])
            continue
        try:
            check_layout(layout, config, seq_len=max(lengths), batch=layout.data_parallel, world_size=world)
            result = check(args, layout, device, log)
        except ImportError as err:
            records.append({"phase": "skip", "layout": str(layout), "why": f"not available here: {err}"})
            log.result(records[-1])
            continue
        records.append(result)
        log.result(result)
        if not result["ok"]:
            log(f"{layout}: FAILED the check (relative RMSE over {CHECK_TOLERANCE}); not timed")
            continue
        for seq in lengths:
            if time.perf_counter() - start > args.budget_s:
                records.append({"phase": "skip", "layout": str(layout), "seq": seq, "why": "time budget spent"})
                log.result(records[-1])
                continue
            records.append(time_length(args, layout, seq, device, log))
            log.result(records[-1])
            if device.type == "cuda":
                torch.cuda.empty_cache()
    text = table(records)
    log(text)
    if rank == 0:
        (out / "table.txt").write_text(text + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if all(r.get("ok", True) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
