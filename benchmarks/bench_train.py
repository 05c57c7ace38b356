"""Training throughput and memory of glm53-mini on one GPU, on real DNA, with the full memory stack.

Phases, each skipped (and recorded as not run) when the time budget is spent:
1. tokens/s, MFU, peak GPU memory and pinned host bytes at each --lengths (a few steps each; the
   first step of a length includes kernel compilation and pinned-buffer registration, so the
   figures are the median of the later steps), each beside the memory plan's estimate;
2. peak memory on uniform random bases at the same lengths (the original recipe's real-data MoE chunking: real routing is
   uneven, random tokens can under-state memory);
3. the ablation (benchmarks/bench_memory_ablation.py), in this process;
4. the overfit check: a fixed set of 4 windows, cycled, until the mean loss over the last 4 steps
   is <= 20% of the first 4 steps' mean, or --overfit-steps steps.

    source .device/activate.sh && python benchmarks/bench_train.py --data data/bundled \
        --lengths 32k,128k,512k --out $OUT/train.json --budget-s 420

`--indexer-loss-coeff 1` makes every step also train the DSA indexer (its sparse KL loss,
docs/training.md): run it beside a run without to measure the loss's step-time and memory cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_memory_ablation import HOST_RAM_GIB, Bench, longest  # noqa: E402

from genolong.model import ops  # noqa: E402
from genolong.train.options import MemoryOptions  # noqa: E402
from genolong.units import format_length, parse_length  # noqa: E402


def parse_keep_moe(text: str) -> list[bool]:
    """--keep-moe "off,on" -> [False, True]."""
    values = {"off": False, "on": True}
    arms = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in arms if x not in values]
    if bad or not arms:
        raise SystemExit(f"--keep-moe: {(bad or [text])[0]!r} is not off or on (a comma list of them, e.g. off,on)")
    return [values[x] for x in arms]


def parse_env_arms(text: str) -> list[dict[str, str]]:
    """'A=1,B=2;A=3' -> [{'A': '1', 'B': '2'}, {'A': '3'}]; '' -> [{}] (one arm, the environment as it is)."""
    arms = []
    for arm in (a for a in text.split(";") if a.strip()):
        pairs = [p.strip() for p in arm.split(",") if p.strip()]
        bad = [p for p in pairs if "=" not in p or not p.split("=", 1)[0]]
        if bad:
            raise SystemExit(f"--env-arms: {bad[0]!r} is not NAME=value (arms are separated by ';', settings by ',')")
        arms.append(dict(p.split("=", 1) for p in pairs))
    return arms or [{}]


def use_env_arm(arm: dict[str, str], arms: list[dict[str, str]], base: dict[str, str]) -> None:
    """Set `arm`'s settings; every other name any arm sets goes back to `base` (the environment the
    run started with), so that no setting of one arm leaks into the next."""
    for name in {n for a in arms for n in a}:
        if name in arm:
            os.environ[name] = arm[name]
        elif name in base:
            os.environ[name] = base[name]
        else:
            os.environ.pop(name, None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None)
    p.add_argument("--preset", default="glm53-mini")
    p.add_argument("--lengths", default="32k,128k,512k")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--random-lengths", default="128k,512k")
    p.add_argument("--census-seq", default="32k")
    p.add_argument("--ablation", default="-recompute,baseline,-offload,-moe_chunking,-mhc_low_precision,-chunked_loss")
    p.add_argument("--overfit-seq", default="128k")
    p.add_argument("--overfit-steps", type=int, default=50)
    p.add_argument("--overfit-lr", type=float, default=2e-3)
    p.add_argument("--kernels", default="fused")
    p.add_argument("--host-budget-gib", type=float, default=0.75 * HOST_RAM_GIB)
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--out", default="train.json")
    p.add_argument("--ladder", default=None, help="ablation lengths (default 8k..512k); for a CPU smoke test")
    p.add_argument("--compile", action="store_true", help="apply genolong.train.compile to the model (finetune --compile)")
    p.add_argument("--compile-no-mhc", action="store_true",
                   help="with --compile: leave mHC to its fused kernels, compile the norms, router and dense MLP only")
    p.add_argument("--keep-sparse", default="auto",
                   help="comma list of MemoryOptions.keep_sparse values; each length runs once per value, side by side")
    p.add_argument("--keep-moe", default="off",
                   help="comma list of off / on (MemoryOptions.keep_moe: the MoE outputs kept for the recompute); "
                        "each length runs once per value, after each keep-sparse value")
    p.add_argument("--env-arms", default="",
                   help="arms of environment settings, e.g. 'GENOLONG_MOE_SWIGLU=eager;GENOLONG_MOE_SWIGLU=triton': "
                        "each length runs once per arm (after each keep-sparse value), one after the other on one model")
    p.add_argument("--indexer-loss-coeff", type=float, default=0.0, help="> 0: every step also trains the DSA indexer (its KL loss)")
    args = p.parse_args(argv)
    if args.ladder:
        import bench_memory_ablation

        bench_memory_ablation.LADDER[:] = [parse_length(x) for x in args.ladder.split(",")]
    start = time.monotonic()

    def left() -> float:
        return args.budget_s - (time.monotonic() - start)

    results: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "not_run": []}
    rows: list = []
    results["rows"] = rows
    jsonl = open(Path(args.out).with_suffix(".jsonl"), "w", encoding="utf-8")

    def record(row: dict) -> None:
        row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        rows.append(row)
        jsonl.write(json.dumps(row) + "\n")
        jsonl.flush()
        print(json.dumps(row), flush=True)

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")

    data = args.data if args.data and Path(args.data).exists() else None
    if data is None:
        results["not_run"].append("real DNA (no --data dir): every figure is on random bases")
    try:
        bench = Bench(args.preset, data, policy=args.kernels, indexer_loss_coeff=args.indexer_loss_coeff)
    except Exception as err:  # a kernel that cannot load under "fused" is a result, not a crash
        results["kernel_error"] = repr(err)
        bench = Bench(args.preset, data, policy="auto", indexer_loss_coeff=args.indexer_loss_coeff)
    results["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    compiled = None
    if args.compile:
        from genolong.train.compile import apply_compile

        compiled = apply_compile(bench.model, mhc=not args.compile_no_mhc)
    results["params"] = sum(p.numel() for p in bench.model.parameters())
    keeps = [k.strip() for k in args.keep_sparse.split(",") if k.strip()]
    full = MemoryOptions(host_budget_gib=args.host_budget_gib, keep_sparse=keeps[0])

    # 1. throughput and memory on real DNA, beside the plan
    arms = parse_env_arms(args.env_arms)
    base_env = dict(os.environ)
    keep_moe = parse_keep_moe(args.keep_moe)
    for n, keep, moe, arm in [(parse_length(x), k, m, a) for x in args.lengths.split(",") for k in keeps for m in keep_moe for a in arms]:
        if left() < 30:
            results["not_run"].append(f"train {format_length(n)} keep_sparse={keep} keep_moe={moe} {arm}: time budget")
            continue
        use_env_arm(arm, arms, base_env)
        opts = MemoryOptions(host_budget_gib=args.host_budget_gib, keep_sparse=keep, keep_moe=moe)
        bench.use(opts)
        k = 0
        while k < args.steps:
            try:
                row = bench.step(bench.window(n, k))
            except ops.KernelFallbackError as err:
                # Recorded, then measured under "auto" (fused where it runs): the audit says which.
                results["kernel_error"] = str(err)
                record({"phase": "train", "seq_len": n, "ok": False, "error": str(err)[:300]})
                ops.use("auto")
                bench.optimizer.zero_grad()
                continue
            except torch.OutOfMemoryError as err:
                record({"phase": "train", "seq_len": n, "ok": False, "offload_layers": opts.offload_layers, "error": str(err).splitlines()[0][:200]})
                _empty_cache()
                if opts.offload_layers is not None or k > 0:
                    break
                # The plan's offload count was too small: measured, not hidden. Retry with 12 more layers.
                planned = bench.plan(n)["plan_offload_layers"]
                opts = MemoryOptions(host_budget_gib=args.host_budget_gib, keep_sparse=keep, keep_moe=moe,
                                     offload_layers=min(bench.config.num_layers, planned + 12))
                bench.use(opts)
                continue
            row.update(bench.plan(n, offload_layers=row["offload_layers"]))
            row.update(phase="train", step=k + 1, ok=True, **({"env": arm} if arm else {}))
            if k == 0:
                row["kernels"] = ops.audit_summary()
                row["memory"] = bench.handle.describe()
            record(row)
            k += 1
            if left() < 20:
                break
        _empty_cache()
        save()

    # 1b. what each layer kind saves for backward with the fused kernels, beside the plan's count
    if args.census_seq and left() > 60:
        results["census"] = census(bench, parse_length(args.census_seq))
        save()

    # 2. real DNA vs random bases
    for n in [parse_length(x) for x in args.random_lengths.split(",") if x]:
        if left() < 40:
            results["not_run"].append(f"random-token peak {format_length(n)}: time budget")
            continue
        bench.use(full)
        try:
            row = bench.step(bench.window(n, 99, random_tokens=True))
            row.update(bench.plan(n, offload_layers=row["offload_layers"]))
            row.update(phase="random", ok=True)
        except torch.OutOfMemoryError as err:
            row = {"phase": "random", "seq_len": n, "ok": False, "error": str(err).splitlines()[0][:200]}
        record(row)
        _empty_cache()
        save()

    # 3. ablation: the longest length that trains per configuration
    summaries = {}
    poisoned = False  # an OOM whose memory was not given back: later phases would measure garbage
    for name in [c for c in args.ablation.split(",") if c]:
        if left() < 60 or poisoned:
            results["not_run"].append(f"ablation {name}: " + ("memory not recovered after an earlier OOM; run bench_memory_ablation.py, which restarts its worker" if poisoned else "time budget"))
            continue

        def rec(row: dict, _name=name) -> None:
            row["phase"] = "ablation"
            record(row)

        try:
            summaries[name] = longest(bench, name, args.host_budget_gib, rec)
        except SystemExit:  # longest() found the allocator not back to its level after an OOM
            poisoned = True
            summaries[name] = {"config": name, "longest": None, "note": "memory not recovered after OOM"}
        _empty_cache()
        save()
    results["ablation"] = summaries

    # 4. overfit on 4 fixed windows
    n = parse_length(args.overfit_seq)
    timed = [r["step_s"] for r in rows if r.get("phase") == "train" and r.get("ok") and r.get("seq_len") == n and r.get("step", 1) > 1]
    need = args.overfit_steps * (min(timed) if timed else 0.0) + 15
    if poisoned:
        results["not_run"].append(f"overfit at {format_length(n)}: memory not recovered after an ablation OOM")
    elif not timed:
        results["not_run"].append(f"overfit at {format_length(n)}: that length was not timed in phase 1")
    elif left() < need:
        results["not_run"].append(f"overfit at {format_length(n)}: {args.overfit_steps} steps need ~{need:.0f} s, {left():.0f} s left")
    else:
        bench.use(full)
        windows = [bench.window(n, 500 + k) for k in range(4)]
        losses = []
        for step in range(args.overfit_steps):
            if left() < 10:
                break
            row = bench.step(windows[step % 4], lr=args.overfit_lr)
            losses.append(row["loss"])
            record({"phase": "overfit", "step": step + 1, "loss": row["loss"], "step_s": row["step_s"]})
            if len(losses) >= 8 and statistics.mean(losses[-4:]) <= 0.2 * statistics.mean(losses[:4]):
                break
        if len(losses) >= 8:
            first, last = statistics.mean(losses[:4]), statistics.mean(losses[-4:])
            results["overfit"] = {"seq_len": n, "steps": len(losses), "first4": first, "last4": last, "drop": 1 - last / first}
        else:
            results["not_run"].append(f"overfit at {format_length(n)}: fewer than 8 steps fit the budget")
    if compiled is not None:
        results["compile"] = compiled.describe()
    save()
    print_summary(results)
    return 0


def census(bench: Bench, seq_len: int) -> list[dict]:
    """Bytes per token that one layer of each kind saves for backward (no recompute), measured
    with saved-tensor hooks on the GPU, against genolong.train.plan.layer_saved_bytes."""
    from genolong.train.census import layer_saved_bytes_per_token
    from genolong.train.plan import layer_saved_bytes

    bench.use(MemoryOptions(recompute=False, offload=False, moe_chunking=False))
    config = bench.config
    kinds = {}
    for i in range(config.num_layers):
        kinds.setdefault((config.layer_types[i], config.mlp_types[i]), i)
    out = []
    for (mixer, mlp), i in kinds.items():
        layer = bench.model.model.layers[i]
        streams = torch.randn(1, seq_len, config.mhc.num_streams, config.hidden, device=bench.device, dtype=torch.bfloat16, requires_grad=True)
        measured = layer_saved_bytes_per_token(layer, streams)
        planned = layer_saved_bytes(config, i, 2)
        out.append({"layer": i, "mixer": mixer, "mlp": mlp, "measured_B_per_token": measured, "plan_B_per_token": planned, "ratio": planned / measured})
        print(json.dumps(out[-1]), flush=True)
        del streams
        _empty_cache()
    return out


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def print_summary(results: dict) -> None:
    print("\nphase   seq     tok/s      MFU   peak GiB  plan GiB  ratio  pinned GiB  offl")
    for r in results["rows"]:
        if r.get("phase") in ("train", "random") and r.get("ok"):
            ratio = r["peak_gib"] / r["plan_gib"] if r.get("plan_gib") else 0
            mfu = f"{r['mfu']:.3f}" if r.get("mfu") is not None else "-"
            print(
                f"{r['phase']:7s} {format_length(r['seq_len']):6s} {r['tokens_per_s']:9.0f} {mfu:>7s} {r['peak_gib']:9.1f} "
                f"{r['plan_gib']:9.1f} {ratio:6.2f} {r['pinned_peak_gib']:10.1f} {r['offload_layers']:5d}"
            )
    for name, s in results.get("ablation", {}).items():
        print(f"ablation {name:20s} longest {format_length(s['longest']) if s.get('longest') else '-'}  first OOM {format_length(s['first_oom']) if s.get('first_oom') else '-'}")
    if "overfit" in results:
        o = results["overfit"]
        print(f"overfit {format_length(o['seq_len'])}: {o['first4']:.3f} -> {o['last4']:.3f} ({o['drop']:.0%}) in {o['steps']} steps")
    for item in results["not_run"]:
        print("NOT RUN:", item)


if __name__ == "__main__":
    sys.exit(main())
