"""Context parallelism on glm53-mini layers: correctness first, then per-layer time, communication and balance.

    source .device/activate.sh && torchrun --standalone --nproc_per_node=2 benchmarks/bench_context.py \
        --out $OUT/context --lengths 512k,1M --budget-s 480

With N processes (one GPU each) the sequence of each length is split over cp=N ranks; with N=1
the same code paths run at cp=1 (their collectives are no-ops), which measures the overhead of the
context-parallel path against the plain layers on one GPU:

    source .device/activate.sh && torchrun --standalone --nproc_per_node=1 benchmarks/bench_context.py \
        --out $OUT/context1 --lengths 128k,512k --budget-s 480

1. check (`--check-seq`, default 16k): a 4-layer glm53-mini model (3 KDA layers, then DSA + MoE),
   bf16, the fused kernel policy, at cp=N against the plain model on rank 0 (same weights, same
   sequence): per-token losses, relative RMSE; over 2e-2 marks a KDA mode FAILED and it is not
   timed. Modes: "state" (fla's CP kernels where they run, else the reference state passing:
   the audit says which) and "ulysses".
2. per length L (each rank holds L/N tokens), forward + backward of one layer, the median of
   `--reps` after one left-out call (compilation, autotuning), the slowest rank:
   - KDA layer: plain (N=1 only), state, ulysses; and the state-passing recurrence alone, both
     implementations (the reference through fla's chunk kernel with a widened value and an
     initial state; fla's own CP kernels);
   - DSA layer: plain (N=1 only), each rank scoring its own queries, zigzag-balanced scoring;
   - the indexer's scoring alone per rank, contiguous vs zigzag (the load balance);
   - communication: each mode's collectives alone at the same sizes (forward and backward),
     and their share of the layer time.
   Per-step figures for a 45-layer model are *estimated* as 34 KDA + 11 DSA layer times (full
   recompute's second forward not included); the table says so.
3. Order: everything that does not need fla's CP kernels first (the Ulysses check and layers, DSA,
   the indexer, the collectives, the reference recurrence), then the state check, the state
   layer and fla's CP recurrence: a fla CP call once ran 7 minutes without output on two H200s
   (undiagnosed), and results.jsonl keeps whatever was measured before a stop.

Every rank writes OUT/rank<r>.log; rank 0 writes OUT/results.jsonl (appended as it goes) and
OUT/table.txt. Once --budget-s is spent the remaining measurements are recorded as skipped (a
started one finishes). Runtime, estimated from the H200 figures in docs (not measured): on a
machine with warm kernel caches ~3-4 minutes for N=1 at 128k,512k and ~5-6 minutes for N=2 at
512k,1M; a fresh machine adds kernel compilation (TileLang, fla autotuning: up to ~5 minutes),
which --budget-s bounds. CPU smoke test (gloo, tiny shapes, reference kernels):

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_context.py --device cpu --preset tiny \
        --lengths 2k --check-seq 1k --reps 1 --out /tmp/context

The indexer's balance alone, in one process (no torchrun; each simulated rank's scoring timed in
turn; on the GPU ~1 minute at 512k,1M):

    python benchmarks/bench_context.py --indexer-balance --device cpu --lengths 16k --out /tmp/balance
    source .device/activate.sh && python benchmarks/bench_context.py --indexer-balance --lengths 512k,1M --out $OUT/balance
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
import torch.distributed as dist

from genolong.model import get_preset, ops
from genolong.model.dsa import DSAAttention
from genolong.model.kda import KimiDeltaAttention
from genolong.parallel.layout import ParallelLayout, check_layout
from genolong.units import format_length, parse_length

CHECK_TOLERANCE = 2e-2


class Log:
    def __init__(self, out: Path, rank: int) -> None:
        self.rank = rank
        self.file = open(out / f"rank{rank}.log", "a")  # noqa: SIM115 (kept open for the run)
        self.results = out / "results.jsonl"

    def __call__(self, *parts) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] " + " ".join(str(p) for p in parts)
        self.file.write(line + "\n")
        self.file.flush()
        if self.rank == 0:
            print(line, flush=True)

    def result(self, record: dict) -> None:
        self(json.dumps(record))
        if self.rank == 0:
            with open(self.results, "a") as f:
                f.write(json.dumps(record) + "\n")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _max(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _gather_floats(value: float, device) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(x) for x in out]


CPU_SECONDS: list[float] = []  # the process CPU time of the last `timed` call (the slowest rank's)


def timed(fn, device, reps: int) -> float:
    """Median wall seconds of fn() over `reps` calls after one left-out call, the slowest rank's; the
    median process CPU seconds go to CPU_SECONDS (the measure on a shared CPU machine)."""
    times, cpu = [], []
    for i in range(reps + 1):
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    CPU_SECONDS[:] = [_max(statistics.median(cpu), device)]
    return _max(statistics.median(times), device)


class Bench:
    def __init__(self, args, device, log) -> None:
        from genolong.parallel.mesh import build_mesh

        self.args, self.device, self.log = args, device, log
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.pmesh = build_mesh(ParallelLayout(cp=self.world), device.type)
        self.group = self.pmesh.group("cp")
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.config = get_preset(args.preset, num_layers=4, **json.loads(args.preset_overrides))
        self.start = time.perf_counter()
        self.records: list[dict] = []

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.start > self.args.budget_s

    def record(self, **fields) -> None:
        self.records.append(fields)
        self.log.result(fields)

    # ------------------------------------------------------------------------------ check
    def model(self):
        from genolong.model.model import GenoLongForCausalLM

        torch.manual_seed(0)
        with torch.device(self.device):
            return GenoLongForCausalLM(self.config, dtype=self.dtype)

    def check(self, kda_mode: str) -> bool:
        from genolong.parallel.context import apply_context_parallel, gather_sequence, shard_batch
        from genolong.train.loss import chunked_token_loss

        seq = parse_length(self.args.check_seq)
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, 4, (1, seq + 1), generator=g).to(self.device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        reference = None
        if self.rank == 0:
            plain = self.model()
            with torch.no_grad():
                reference = chunked_token_loss(plain.hidden_states(inputs), plain.lm_head.weight, targets, 8192)
            del plain
        model = apply_context_parallel(self.model(), self.pmesh, kda_mode=kda_mode)
        mine = shard_batch(inputs, targets, targets >= 0, self.rank, self.world)
        ops.reset_audit()
        per_token = chunked_token_loss(model.hidden_states(mine[0]), model.lm_head.weight, mine[1], 8192)
        (per_token.sum() / targets.numel()).backward()
        whole = gather_sequence(per_token.detach(), self.group)
        err = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.rank == 0:
            err[0] = (whole - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()
        dist.broadcast(err, 0)
        ok = float(err) <= CHECK_TOLERANCE
        self.record(phase="check", kda_mode=kda_mode, seq=seq, rel_rmse=float(err), ok=ok, audit=ops.audit_summary())
        return ok

    # ------------------------------------------------------------------------------ layers
    def layer(self, cls, **kw):
        torch.manual_seed(1)
        cfg, hidden = self.config, self.config.hidden
        with torch.device(self.device):
            if cls is KimiDeltaAttention:
                module = KimiDeltaAttention(hidden, cfg.kda, cfg.rms_eps, 0)
            else:
                module = DSAAttention(hidden, cfg.dsa, cfg.rms_eps, 3, has_indexer=True)
        for name, p in module.named_parameters():
            keep = name.endswith(("conv1d.weight", "dt_bias", "A_log"))
            with torch.no_grad():
                if p.dim() > 1 and not name.endswith("conv1d.weight"):
                    p.normal_(0.0, 0.02)
            p.data = p.data.to(torch.float32 if keep else self.dtype)
        return module

    def apply(self, module, kind: str, kda_mode: str = "state", balanced: bool = True):
        from genolong.parallel.context_group import ContextGroup
        from genolong.parallel.context_dsa import BalancedIndexer, ContextParallelDSA
        from genolong.parallel.context_kda import ContextParallelKDA

        cp = ContextGroup(self.group, self.rank, self.world)
        if kind == "kda":
            module.__class__, module.cp, module.kda_mode = ContextParallelKDA, cp, kda_mode
        else:
            module.__class__, module.cp = ContextParallelDSA, cp
            if balanced:
                module.indexer.__class__, module.indexer.cp = BalancedIndexer, cp
        return module

    def fwd_bwd(self, module, local: int):
        x = torch.randn(1, local, self.config.hidden, device=self.device, dtype=self.dtype, requires_grad=True)

        def step():
            out = module(x)
            out = out[0] if isinstance(out, tuple) else out
            out.float().square().mean().backward()
            module.zero_grad(set_to_none=True)
            x.grad = None

        return step

    def time_layers(self, seq: int, variants: list[tuple[str, str, object]]) -> None:
        """Forward + backward of one layer per (kind, variant name, mode) at `seq` (module docstring)."""
        local = seq // self.world
        for kind, name, how in variants:
            if self.out_of_time():
                self.record(phase="skip", seq=seq, layer=kind, variant=name, why="time budget spent")
                continue
            cls = KimiDeltaAttention if kind == "kda" else DSAAttention
            module = self.layer(cls)
            if name != "plain":
                module = self.apply(module, kind, kda_mode=how if kind == "kda" else "state", balanced=bool(how))
            ops.reset_audit()
            try:
                seconds = timed(self.fwd_bwd(module, local), self.device, self.args.reps)
            except (torch.cuda.OutOfMemoryError, ops.KernelFallbackError) as why:
                # Every rank meets the same shapes, so every rank stops at the same call.
                self.record(phase="skip", seq=seq, layer=kind, variant=name, why=f"{type(why).__name__}: {str(why)[:300]}")
                del module
                self.free()
                continue
            peak = _max(torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0, self.device)
            self.record(phase="layer", seq=seq, cp=self.world, layer=kind, variant=name, fwd_bwd_s=seconds, peak_gib=peak,
                        cpu_s=CPU_SECONDS[0], audit=ops.audit_summary())
            del module
            self.free()

    def time_recurrence(self, seq: int, names: tuple[str, ...]) -> None:
        """The state-passing "kda_cp" op alone (implementations `names`), and the plain "kda" op at N=1."""
        from genolong.parallel.context_kda import kda_cp_reference
        from genolong.parallel.context_kda_fla import kda_cp_fla

        local, cfg = seq // self.world, self.config.kda
        g = torch.Generator(device=self.device).manual_seed(2)
        shape = (1, local, cfg.num_heads, cfg.head_dim)
        q, k, v = (torch.randn(*shape, device=self.device, generator=g).to(self.dtype).requires_grad_() for _ in range(3))
        gate = (-5 * torch.sigmoid(torch.randn(*shape, device=self.device, generator=g) - 3)).to(self.dtype).requires_grad_()
        beta = torch.sigmoid(torch.randn(*shape[:3], device=self.device, generator=g)).to(self.dtype).requires_grad_()
        impls = {"state reference": lambda: kda_cp_reference(q, k, v, gate, beta, group=self.group, layer=0),
                 "state fla_cp": lambda: kda_cp_fla(q, k, v, gate, beta, group=self.group),
                 "plain": lambda: ops.call("kda", 0, q, k, v, gate, beta)}
        for name, fn in ((n, impls[n]) for n in names if n != "plain" or self.world == 1):
            def step(fn=fn):
                fn().float().square().mean().backward()
            try:
                seconds = timed(step, self.device, self.args.reps)
            except (ops.KernelUnsupported, torch.cuda.OutOfMemoryError) as why:
                self.record(phase="recurrence", seq=seq, impl=name, why=str(why))
                continue
            self.record(phase="recurrence", seq=seq, cp=self.world, impl=name, fwd_bwd_s=seconds, cpu_s=CPU_SECONDS[0])
        self.free()

    def time_indexer(self, seq: int) -> None:
        """The indexer's scoring per rank: own contiguous queries vs the zigzag blocks (no communication)."""
        from genolong.parallel.context_dsa import ZigzagPlan

        cfg, local = self.config.dsa.indexer, seq // self.world
        g = torch.Generator(device=self.device).manual_seed(3)
        q = torch.randn(1, local, cfg.n_heads, cfg.head_dim, device=self.device, generator=g).to(self.dtype)
        keys = torch.randn(1, seq // cfg.kpool, cfg.head_dim, device=self.device, generator=g).to(self.dtype)
        w = torch.randn(1, local, cfg.n_heads, device=self.device, generator=g)
        kw = dict(kpool=cfg.kpool, topk_pools=cfg.topk_pools, always_select_tail=cfg.always_select_tail, softmax_scale=cfg.head_dim**-0.5)
        plan = ZigzagPlan(self.rank, self.world, local // 2)
        half = local // 2

        def contiguous():
            ops.call("dsa_indexer_topk", 3, q, keys, w, query_offset=self.rank * local, **kw)

        def zigzag():
            for i, b in enumerate(plan.received):
                ops.call("dsa_indexer_topk", 3, q[:, i * half : (i + 1) * half], keys, w[:, i * half : (i + 1) * half],
                         query_offset=b * half, **kw)

        for name, fn in (("contiguous", contiguous), ("zigzag", zigzag)):
            times = []
            for i in range(self.args.reps + 1):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                fn()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                if i:
                    times.append(time.perf_counter() - t0)
            per_rank = _gather_floats(statistics.median(times), self.device)
            self.record(phase="indexer", seq=seq, cp=self.world, assignment=name, per_rank_s=per_rank,
                        slowest_s=max(per_rank), slowest_over_mean=max(per_rank) / (sum(per_rank) / len(per_rank)))
        self.free()

    def time_comms(self, seq: int) -> None:
        """Each mode's collectives alone at the layer's sizes, forward + backward (their adjoints)."""
        from genolong.parallel.collectives import from_previous_rank, gather_along, scatter_sum_along

        local, cfg, hidden = seq // self.world, self.config, self.config.hidden
        dev, dt = self.device, self.dtype
        x = torch.randn(1, local, hidden, device=dev, dtype=dt, requires_grad=True)
        kd = cfg.kda
        summary = torch.randn(1, 1, kd.num_heads, kd.head_dim, 2 * kd.head_dim, device=dev, requires_grad=True)
        halo = torch.randn(1, kd.conv_kernel - 1, 3 * kd.qkv_dim, device=dev, dtype=dt, requires_grad=True)
        latent = torch.randn(1, local, cfg.dsa.kv_lora_rank, device=dev, dtype=dt, requires_grad=True)

        def ulysses():
            scatter_sum_along(gather_along(x, 1, self.group), 1, self.group).float().sum().backward()

        def state():
            (gather_along(summary, 0, self.group).sum() + from_previous_rank(halo, self.group).float().sum()).backward()

        def dsa():
            gather_along(latent, 1, self.group).float().sum().backward()

        for name, fn, (kind, variant) in (("kda ulysses", ulysses, ("kda", "ulysses")), ("kda state", state, ("kda", "state")),
                                          ("dsa latent", dsa, ("dsa", "zigzag"))):
            seconds = timed(fn, dev, self.args.reps)
            self.record(phase="comm", seq=seq, cp=self.world, what=name, fwd_bwd_s=seconds, cpu_s=CPU_SECONDS[0], layer=kind, variant=variant)
        self.free()

    def free(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)


def indexer_balance(args, log) -> None:
    """One process, no communication: the indexer's scoring of each simulated cp rank's queries at
    `--lengths`, contiguous shards vs zigzag blocks, for cp = `--balance-cp`; wall and process CPU time."""
    from genolong.parallel.context_dsa import ZigzagPlan

    device = torch.device(args.device if args.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cfg = get_preset(args.preset, **json.loads(args.preset_overrides)).dsa.indexer
    kw = dict(kpool=cfg.kpool, topk_pools=cfg.topk_pools, always_select_tail=cfg.always_select_tail, softmax_scale=cfg.head_dim**-0.5)
    lines = ["| length | cp | assignment | per rank: wall s (CPU s) | slowest wall s | slowest / mean |", "|---|---|---|---|---|---|"]
    for seq in (parse_length(x) for x in args.lengths.split(",")):
        g = torch.Generator(device=device).manual_seed(3)
        q = torch.randn(1, seq, cfg.n_heads, cfg.head_dim, device=device, generator=g).to(dtype)
        keys = torch.randn(1, seq // cfg.kpool, cfg.head_dim, device=device, generator=g).to(dtype)
        w = torch.randn(1, seq, cfg.n_heads, device=device, generator=g)

        def score(a: int, b: int) -> tuple[float, float]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0, c0 = time.perf_counter(), time.process_time()
            ops.call("dsa_indexer_topk", 3, q[:, a:b], keys, w[:, a:b], query_offset=a, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - t0, time.process_time() - c0

        score(0, seq // 8)  # warm-up (kernel compilation on the GPU)
        for cp in (int(c) for c in args.balance_cp.split(",")):
            local, half = seq // cp, seq // (2 * cp)
            assignments = {
                "contiguous": [[(r * local, (r + 1) * local)] for r in range(cp)],
                "zigzag": [[(b * half, (b + 1) * half) for b in ZigzagPlan(r, cp, half).received] for r in range(cp)],
            }
            for name, ranks in assignments.items():
                per_rank = [tuple(map(sum, zip(*(score(a, b) for a, b in blocks)))) for blocks in ranks]
                walls = [t for t, _ in per_rank]
                record = {"phase": "indexer_balance", "seq": seq, "cp": cp, "assignment": name, "device": str(device),
                          "per_rank_wall_s": walls, "per_rank_cpu_s": [c for _, c in per_rank]}
                log.result(record)
                cells = ", ".join(f"{t:.2f} ({c:.2f})" for t, c in per_rank)
                lines.append(f"| {format_length(seq)} | {cp} | {name} | {cells} | {max(walls):.2f} | {max(walls) / (sum(walls) / cp):.2f} |")
    text = "\n".join(lines)
    log("\n" + text)
    (Path(args.out) / "indexer_balance.txt").write_text(text + "\n")


def table(records: list[dict]) -> str:
    lines = ["| length | cp | what | fwd+bwd ms (slowest rank) | notes |", "|---|---|---|---|---|"]
    by = {(r["seq"], r["layer"], r["variant"]): r["fwd_bwd_s"] for r in records if r["phase"] == "layer"}
    for r in records:
        seq = format_length(r["seq"]) if "seq" in r else ""
        if r["phase"] == "check":
            lines.append(f"| {seq} | | check {r['kda_mode']} | | rel RMSE {r['rel_rmse']:.2e} {'ok' if r['ok'] else 'FAILED'} |")
        elif r["phase"] == "layer":
            lines.append(f"| {seq} | {r['cp']} | {r['layer']} layer, {r['variant']} | {1e3 * r['fwd_bwd_s']:.1f} | peak {r['peak_gib']:.1f} GiB; CPU {1e3 * r['cpu_s']:.0f} ms |")
        elif r["phase"] == "recurrence" and "fwd_bwd_s" in r:
            lines.append(f"| {seq} | {r['cp']} | KDA recurrence, {r['impl']} | {1e3 * r['fwd_bwd_s']:.1f} | CPU {1e3 * r['cpu_s']:.0f} ms |")
        elif r["phase"] == "indexer":
            per = ", ".join(f"{1e3 * t:.0f}" for t in r["per_rank_s"])
            lines.append(f"| {seq} | {r['cp']} | indexer scoring, {r['assignment']} (fwd) | {1e3 * r['slowest_s']:.1f} | per rank {per}; slowest/mean {r['slowest_over_mean']:.2f} |")
        elif r["phase"] == "comm":
            layer = by.get((r["seq"], r["layer"], r["variant"]))
            share = "" if not layer else f"{100 * r['fwd_bwd_s'] / layer:.0f}% of the {r['layer']} layer ({r['variant']})"
            lines.append(f"| {seq} | {r['cp']} | collectives alone: {r['what']} | {1e3 * r['fwd_bwd_s']:.1f} | {share} |")
        elif r["phase"] == "skip":
            lines.append(f"| {seq} | | {r.get('layer', '')} {r.get('variant', r.get('kda_mode', ''))} | skipped | {r['why']} |")
    for seq in sorted({s for s, _, _ in by}):
        for kda, dsa in (("state", "zigzag"), ("ulysses", "zigzag"), ("plain", "plain")):
            if (seq, "kda", kda) in by and (seq, "dsa", dsa) in by:
                est = 34 * by[(seq, "kda", kda)] + 11 * by[(seq, "dsa", dsa)]
                lines.append(f"| {format_length(seq)} | | estimate, not measured: 34 KDA ({kda}) + 11 DSA ({dsa}) layers | {1e3 * est:.0f} | "
                             "mixers only, one forward + backward, no recompute |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="glm53-mini")
    p.add_argument("--preset-overrides", default="{}", help='JSON for get_preset, e.g. \'{"dsa": {"indexer": {"topk": 64}}}\'')
    p.add_argument("--lengths", default="512k,1M", help="whole-sequence lengths; each rank holds length / N")
    p.add_argument("--check-seq", default="16k")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernels", default="fused", help="hot-op policy on CUDA: fused or auto")
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--out", required=True)
    p.add_argument("--indexer-balance", action="store_true",
                   help="only the indexer's per-rank scoring, contiguous vs zigzag, in one process (no torchrun needed)")
    p.add_argument("--balance-cp", default="2,4", help="cp sizes simulated by --indexer-balance")
    args = p.parse_args(argv)
    if args.indexer_balance:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        import genolong.kernels

        genolong.kernels.load()
        ops.use(args.kernels if args.device == "cuda" else "reference")
        indexer_balance(args, Log(out, 0))
        return 0

    from genolong.parallel.mesh import init_distributed

    if "WORLD_SIZE" not in os.environ:  # plain python: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out, rank)
    import genolong.kernels

    genolong.kernels.load()
    ops.use(args.kernels if device.type == "cuda" else "reference")
    log(f"bench_context: cp={world}, {device}, preset {args.preset}, kernels {ops.current_policy()}, torch {torch.__version__}")
    bench = Bench(args, device, log)
    lengths = [parse_length(x) for x in args.lengths.split(",") if x.strip()]
    for seq in lengths:
        check_layout(ParallelLayout(cp=world), bench.config, seq_len=seq, batch=1, world_size=world)
    # fla's CP kernels (the state mode under the fused policy) once ran for 7 minutes without output
    # on two H200s (undiagnosed): everything that does not need them is measured first, and every
    # result is appended to results.jsonl as it comes.
    plain = [("kda", "plain", None), ("dsa", "plain", None)] if world == 1 else []
    dsa = [("dsa", "own queries", False), ("dsa", "zigzag", True)]
    ulysses_ok = bench.config.kda.num_heads % world == 0 and bench.check("ulysses")
    for seq in lengths:
        log(f"length {format_length(seq)}: {format_length(seq // world)} tokens per rank")
        bench.time_layers(seq, plain + ([("kda", "ulysses", "ulysses")] if ulysses_ok else []) + dsa)
        for extra in (lambda: bench.time_recurrence(seq, ("plain", "state reference")), lambda: bench.time_indexer(seq),
                      lambda: bench.time_comms(seq)):
            if not bench.out_of_time():
                extra()
    state_ok = bench.check("state")
    for seq in lengths:
        if state_ok:
            bench.time_layers(seq, [("kda", "state", "state")])
        if not bench.out_of_time():
            bench.time_recurrence(seq, ("state fla_cp",))
    failed = [m for m, ok in (("ulysses", ulysses_ok), ("state", state_ok)) if not ok]
    if failed:
        log(f"FAILED the check (or, for ulysses, heads do not split over {world}): {', '.join(failed)}; not timed")
    text = table(bench.records)
    log("\n" + text)
    if rank == 0:
        (out / "table.txt").write_text(text + "\n")
    dist.destroy_process_group()
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
