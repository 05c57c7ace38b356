"""A glm53-mini training step with and without the compile pass (genolong.train.compile), one GPU.

    source .device/activate.sh && python benchmarks/bench_compile_step.py --data /tmp/bundled --seq 128k --out $OUT/compile

1. Parity at --parity-seq (8k): loss and gradients of one window, eager vs compiled, same weights
   (relative loss difference, relative gradient error over all parameters).
2. --steps training steps at --seq eager, then the same number compiled (after one untimed
   compiled step that includes compilation), full memory stack, fused kernels, real DNA when
   --data is given: median step time, tokens/s, peak GiB, and the compile time.
3. One compiled step under torch.profiler, GPU time by kind of work (profile_step.py's categories).
4. mHC's 24-logit projection alone at --seq (forward + backward, [T, 4 x hidden] x [4 x hidden, 24]):
   as the model runs it, with the weight padded to 32 rows, and with the weight stored transposed,
   beside the memory-bound floor (the bytes a fwd + bwd must move at 4.3 TB/s).
Rows go to <out>/compile_step.jsonl as they are measured; a summary prints last. About 5 min at
128k on an H200 (plus ~2 min of TileLang builds on a machine without the .kcache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_memory_ablation import HOST_RAM_GIB, Bench  # noqa: E402

from genolong.train.compile import apply_compile  # noqa: E402
from genolong.train.loss import auto_chunk_tokens, chunked_lm_loss  # noqa: E402
from genolong.train.options import MemoryOptions  # noqa: E402
from genolong.units import parse_length  # noqa: E402
from genolong.vocab import N_ID  # noqa: E402


def loss_and_grads(bench: Bench, tokens: torch.Tensor):
    model = bench.model
    model.zero_grad(set_to_none=True)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    hidden = model.hidden_states(inputs)
    loss = chunked_lm_loss(hidden, model.lm_head.weight, targets, targets != N_ID, auto_chunk_tokens(bench.config.vocab_size))
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return float(loss), grads


def profile_categories(bench: Bench, seq: int, out: Path) -> dict:
    """GPU ms by kind of work of one compiled step (kernel events read from the exported trace, as
    profile_step.py does); the top kernels go to <out>/kernels_compiled.txt."""
    from profile_step import categorize
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        bench.step(bench.window(seq, 99))
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    per_kernel: dict[str, float] = {}
    for ev in json.loads(trace.read_text()).get("traceEvents", []):
        if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in ev:
            per_kernel[ev["name"]] = per_kernel.get(ev["name"], 0.0) + ev["dur"] / 1e3
    trace.unlink()
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    (out / "kernels_compiled.txt").write_text("".join(f"{ms:9.1f}  {name[:150]}\n" for name, ms in top[:60]))
    cats: dict[str, float] = {}
    for name, ms in top:
        cats[categorize(name)] = cats.get(categorize(name), 0.0) + ms
    return {k: round(v, 1) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])}


def projection_variants(hidden: int, streams: int, seq: int) -> dict:
    """ms of the mHC projection's forward + backward in three layouts, and the memory-bound floor."""
    from bench_kernels import measure

    flat = torch.randn(seq, streams * hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fn = (torch.randn(streams * (streams + 2), streams * hidden, device="cuda") * 0.02).bfloat16().requires_grad_()
    fn32 = torch.nn.functional.pad(fn.detach(), (0, 0, 0, 32 - fn.shape[0])).requires_grad_()
    fn_t = fn.detach().t().contiguous().requires_grad_()
    cases = {
        "F.linear(flat, fn[24])": lambda: torch.nn.functional.linear(flat, fn),
        "F.linear(flat, fn padded to 32)[:, :24]": lambda: torch.nn.functional.linear(flat, fn32)[:, :24],
        "flat @ fn_t (weight stored [K, 24])": lambda: flat @ fn_t,
    }
    out = {}
    for name, fwd in cases.items():
        def both(fwd=fwd):
            flat.grad = None
            fwd().float().sum().backward()
        out[name] = round(measure(both, 5)[0], 3)
    # Forward reads flat; backward reads flat (weight grad) and writes its gradient.
    out["memory-bound floor"] = round(3 * flat.numel() * 2 / 4.3e12 * 1e3, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--preset", default="glm53-mini")
    ap.add_argument("--seq", default="128k")
    ap.add_argument("--parity-seq", default="8k")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-projection", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("runs/compile_step"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "compile_step.jsonl").open("a")

    def record(row):
        row = {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in row.items()}
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row), flush=True)
        return row

    data = args.data if args.data and Path(args.data).exists() else None
    bench = Bench(args.preset, data, policy="fused")
    bench.use(MemoryOptions(host_budget_gib=0.75 * HOST_RAM_GIB))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke test)"
    print(f"device {device}, torch {torch.__version__}, real DNA: {data is not None}", flush=True)

    seq = parse_length(args.seq)
    if not args.no_projection:
        record({"phase": "mhc projection fwd+bwd ms", "seq_len": seq,
                **projection_variants(bench.config.hidden, bench.config.mhc.num_streams, seq)})

    parity_window = bench.window(parse_length(args.parity_seq), 7)
    eager_loss, eager_grads = loss_and_grads(bench, parity_window)

    eager = [bench.step(bench.window(seq, k)) for k in range(args.steps + 1)][1:]  # step 1 builds kernels
    for r in eager:
        record({"phase": "eager", **r})

    handle = apply_compile(bench.model)
    t0 = time.perf_counter()
    first = bench.step(bench.window(seq, args.steps + 1))
    compile_s = time.perf_counter() - t0
    record({"phase": "compiled first step (includes compilation)", "wall_s": compile_s, **first})
    compiled = [record({"phase": "compiled", **bench.step(bench.window(seq, args.steps + 2 + k))}) for k in range(args.steps)]

    loss, grads = loss_and_grads(bench, parity_window)  # weights moved: compare against eager on these weights
    handle.remove()
    ref_loss, ref_grads = loss_and_grads(bench, parity_window)
    apply_compile(bench.model)
    parity = record({"phase": "parity", "seq_len": parity_window.shape[1] - 1,
                     "loss_eager": ref_loss, "loss_compiled": loss, "loss_rel_diff": abs(loss - ref_loss) / abs(ref_loss),
                     "grad_rel_err": float((grads - ref_grads).norm() / ref_grads.norm()),
                     "first_window_loss_eager": eager_loss, "grad_norm_eager_initial": float(eager_grads.norm())})
    described = record({"phase": "compile", **handle.describe()})

    categories = None
    if not args.no_profile:
        categories = record({"phase": "profile compiled", "categories_ms": profile_categories(bench, seq, args.out)})

    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    print(f"\n{args.preset} {args.seq}, full memory stack, fused kernels ({'real DNA' if data else 'random bases'})")
    print(f"{'':<10} {'step s':>8} {'tokens/s':>10} {'peak GiB':>9}")
    for name, rows in (("eager", eager), ("compiled", compiled)):
        print(f"{name:<10} {med(rows, 'step_s'):8.2f} {med(rows, 'tokens_per_s'):10.0f} {max(r['peak_gib'] for r in rows):9.2f}")
    print(f"first compiled step {compile_s:.1f} s (compilation included); graphs {described['graphs_compiled']}, "
          f"graph breaks {described['graph_breaks']}, sinkhorn {described['sinkhorn']}")
    print(f"parity at {args.parity_seq}: loss rel diff {parity['loss_rel_diff']:.2e}, grad rel err {parity['grad_rel_err']:.2e}")
    if categories:
        print("compiled step by kind of work (GPU ms):", categories["categories_ms"])


if __name__ == "__main__":
    main()
