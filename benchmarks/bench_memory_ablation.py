"""Memory ablation on one GPU: the longest sequence that trains, full stack vs each optimization removed.

For each configuration (the full stack, the full stack minus one optimization, `--baseline`), one
training step (forward, backward, AdamW step) on a real DNA window is tried at a ladder of
lengths (powers of two, 8k-512k), starting at the length the memory plan predicts to be the
longest that fits and moving up after a success, down after an out-of-memory. A step that runs out
of memory is cleaned up in the same process (its tensors dropped, the allocator cache emptied) and
the allocated bytes are checked to be back at the level before the attempt; if they are not, the
remaining configurations are run in a fresh process. (They are not after an OOM inside backward:
the autograd graph of the failed step stays alive, held from C++ with no Python referrer,
pytorch/pytorch#82218; a simulated OOM in a layer's recompute reproduces it on the CPU.) Kernels are compiled and autotuned once per
process, which is why attempts are not one process each.

    source .device/activate.sh && python benchmarks/bench_memory_ablation.py --data data/bundled \
        --preset glm53-mini --out $OUT/ablation.jsonl

Also the shared step code of benchmarks/bench_train.py (`Bench`).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from genolong.model import GenoLongForCausalLM, get_preset, ops  # noqa: E402
from genolong.train.flops import peak_flops, step_flops  # noqa: E402
from genolong.train.indexer import IndexerTraining, trainable_parameters  # noqa: E402
from genolong.train.loss import auto_chunk_tokens, chunked_lm_loss, full_lm_loss  # noqa: E402
from genolong.train.memory import apply_memory_optimizations  # noqa: E402
from genolong.train.optim import MasterAdamW, clip_scale  # noqa: E402
from genolong.train.options import MemoryOptions  # noqa: E402
from genolong.train.plan import estimate_memory, moe_chunks_checkpointed  # noqa: E402
from genolong.units import format_length, parse_length  # noqa: E402

CUDA = torch.cuda.is_available()


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def _device_total() -> int:
    from genolong.train.plan import H200_BYTES

    return torch.cuda.get_device_properties(0).total_memory if CUDA else H200_BYTES
from genolong.vocab import N_ID  # noqa: E402

GIB = 1024**3
LADDER = [8192 * 2**i for i in range(7)]  # 8k .. 512k (--ladder for the CPU smoke test)
HOST_RAM_GIB = 128  # the H200 machine's RAM (MemTotal inside its VM can read lower while it grows)

# Each configuration: the full stack with one switch changed, or the baseline.
CONFIGS = {
    "full": {},
    "-recompute": dict(recompute=False, offload=False),
    "-offload": dict(offload=False),
    "-moe_chunking": dict(moe_chunking=False),
    "-mhc_low_precision": dict(mhc_low_precision=False),
    "-chunked_loss": dict(chunked_loss=False),
    "baseline": "baseline",
}


def memory_options(name: str, host_budget_gib: float) -> MemoryOptions:
    change = CONFIGS[name]
    if change == "baseline":
        return MemoryOptions.baseline(host_budget_gib=host_budget_gib)
    return MemoryOptions(host_budget_gib=host_budget_gib, **change)


@dataclass
class Bench:
    """One model + optimizer on the GPU, stepped on windows of any length under any memory options."""

    preset: str
    data: str | None
    policy: str = "fused"
    lr: float = 1e-4
    seed: int = 0
    log: list = field(default_factory=list)
    indexer_loss_coeff: float = 0.0  # > 0: every step also trains the DSA indexer (sparse KL loss)

    def __post_init__(self) -> None:
        import genolong.kernels

        genolong.kernels.load()
        ops.use(self.policy if CUDA else "reference")
        torch.manual_seed(self.seed)
        # CPU only for a smoke test of this script (tiny preset, short lengths).
        self.device = torch.device("cuda" if CUDA else "cpu")
        self.config = get_preset(self.preset)
        with torch.device(self.device):
            self.model = GenoLongForCausalLM(self.config, dtype=torch.bfloat16 if CUDA else torch.float32)
        self.model.train()
        self.indexer = IndexerTraining(self.model, coeff=self.indexer_loss_coeff)
        self.optimizer = MasterAdamW(trainable_parameters(self.model, train_indexer=self.indexer.trains), lr=self.lr)
        self.handle = None
        self.opts = None
        self.genome = None
        if self.data:
            from genolong.data import open_prepared

            self.genome = open_prepared(self.data)
        self.peak = peak_flops(torch.cuda.get_device_name(self.device)) if CUDA else None
        self.static_bytes = _allocated()

    def use(self, opts: MemoryOptions) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.opts = opts
        self.handle = apply_memory_optimizations(self.model, opts)

    def window(self, seq_len: int, k: int = 0, random_tokens: bool = False) -> torch.Tensor:
        """seq_len + 1 token ids: a real DNA window of the prepared genome, or uniform random bases."""
        if random_tokens or self.genome is None:
            g = np.random.default_rng(1000 + k)
            ids = g.integers(0, 4, seq_len + 1, dtype=np.int64)
        else:
            from genolong.data import WindowSampler

            sampler = WindowSampler(self.genome, "train", seq_len + 1, seed=self.seed, max_n_fraction=0.1)
            ids = sampler.window(k).tokens.astype(np.int64)
        return torch.from_numpy(ids).to(self.device).unsqueeze(0)

    def step(self, tokens: torch.Tensor, lr: float | None = None) -> dict:
        """One training step as genolong.train.loop does it (chunked or full loss per opts)."""
        _sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        self.handle.reset_stats()
        seq_len = tokens.shape[1] - 1
        t0 = time.perf_counter()
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        valid = targets != N_ID
        self.indexer.begin_step(0)
        hidden = self.model.hidden_states(inputs)
        if self.opts.chunked_loss:
            chunk = self.opts.loss_chunk_tokens or auto_chunk_tokens(self.config.vocab_size)
            loss = chunked_lm_loss(hidden, self.model.lm_head.weight, targets, valid, chunk)
        else:
            loss = full_lm_loss(hidden, self.model.lm_head.weight, targets, valid)
        loss.backward()
        del hidden
        loss_value = float(loss.detach())
        del loss
        norm = self.optimizer.grad_norm()
        if math.isfinite(norm) and math.isfinite(loss_value):
            self.optimizer.step(lr if lr is not None else self.lr, clip_scale(norm, 1.0))
        self.optimizer.zero_grad()
        indexer = self.indexer.end_step()
        _sync()
        elapsed = time.perf_counter() - t0
        flops = step_flops(self.config, seq_len, recompute=self.opts.recompute, chunked_loss=self.opts.chunked_loss,
                           moe_recompute=moe_chunks_checkpointed(seq_len, self.opts) and not self.opts.keeps_moe())
        stats = self.handle.stats
        return {
            "seq_len": seq_len,
            "loss": loss_value,
            "grad_norm": norm,
            "step_s": elapsed,
            "tokens_per_s": seq_len / elapsed,
            "mfu": flops.model / elapsed / self.peak if self.peak else None,
            "hfu": flops.hardware / elapsed / self.peak if self.peak else None,
            "peak_gib": torch.cuda.max_memory_allocated() / GIB if CUDA else 0.0,
            "reserved_gib": torch.cuda.max_memory_reserved() / GIB if CUDA else 0.0,
            "pinned_peak_gib": (stats.peak_pinned_bytes / GIB) if stats is not None else 0.0,
            "pinned_reserved_gib": self.handle.reserved_bytes() / GIB,
            "pinned_after_step_gib": self.handle.pinned_bytes() / GIB,
            "offload_layers": len(self.handle.offload_layers()),
            "indexer_loss": indexer.get("indexer_loss"),
            "keep_sparse": self.handle.describe()["keep_sparse"],
            "keep_moe": self.handle.describe()["keep_moe"],
            "kept_gib": self.handle.keep.stats.bytes_kept / GIB if self.handle.keep is not None else 0.0,
            "kept_replayed": self.handle.keep.stats.replayed if self.handle.keep is not None else 0,
        }

    def plan(self, seq_len: int, offload_layers: int | None = None) -> dict:
        total = _device_total()
        est = estimate_memory(self.config, seq_len, self.opts, 1, total, offload_layers=offload_layers, host_bytes=HOST_RAM_GIB * GIB)
        return {"plan_gib": est.gpu_total / GIB, "plan_host_gib": est.host_total / GIB, "plan_offload_layers": est.offload_layers, "plan_fits": est.fits}

    def try_step(self, tokens: torch.Tensor) -> dict:
        """A step that may run out of memory; afterwards the allocator is back where it started."""
        try:
            out = self.step(tokens)
            out["ok"] = True
        except torch.OutOfMemoryError as err:
            out = {"seq_len": tokens.shape[1] - 1, "ok": False, "error": str(err).splitlines()[0][:200]}
        except RuntimeError as err:  # allocation failures inside fused kernels surface as RuntimeError
            if "out of memory" not in str(err).lower():
                raise
            out = {"seq_len": tokens.shape[1] - 1, "ok": False, "error": str(err).splitlines()[0][:200]}
        if not out["ok"]:
            self.optimizer.zero_grad()
            gc.collect()
            _sync()
            if CUDA:
                torch.cuda.empty_cache()
            out["recovered"] = _allocated() <= self.static_bytes + 64 * 2**20
        return out


def longest(bench: Bench, name: str, host_budget_gib: float, record) -> dict:
    """Walk the ladder from the plan's prediction; returns the longest length that trained."""
    opts = memory_options(name, host_budget_gib)
    bench.use(opts)
    total = _device_total()
    fits = [n for n in LADDER if estimate_memory(bench.config, n, opts, 1, total, host_bytes=HOST_RAM_GIB * GIB).fits]
    i = LADDER.index(fits[-1]) if fits else 0
    best, worst_fail = None, None
    tried = set()
    while 0 <= i < len(LADDER) and LADDER[i] not in tried:
        n = LADDER[i]
        tried.add(n)
        result = bench.try_step(bench.window(n))
        result.update(bench.plan(n))
        result["config"] = name
        record(result)
        if result["ok"]:
            best = n if best is None else max(best, n)
            if worst_fail is not None and LADDER[i + 1 : i + 2] == [worst_fail]:
                break
            i += 1
        else:
            worst_fail = n if worst_fail is None else min(worst_fail, n)
            if not result.get("recovered", True):
                raise SystemExit(3)  # the driver restarts the remaining configurations in a new process
            if best is not None:
                break
            i -= 1
    summary = {
        "config": name,
        "summary": True,
        "longest": best,
        "first_oom": worst_fail,
        "ceiling": LADDER[-1] if best == LADDER[-1] else None,
    }
    record(summary)
    return summary


def run_worker(args) -> None:
    bench = Bench(args.preset, args.data, policy=args.kernels)
    out = open(args.out, "a", encoding="utf-8")

    def record(row: dict) -> None:
        row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row), flush=True)

    deadline = time.monotonic() + args.budget_s
    for name in args.configs.split(","):
        if time.monotonic() > deadline:
            record({"config": name, "summary": True, "longest": None, "not_run": "time budget"})
            continue
        longest(bench, name, args.host_budget_gib, record)


def run_driver(args) -> int:
    """Run the worker; if it exits with 3 (memory not recovered after an OOM), restart it on the rest."""
    remaining = args.configs.split(",")
    start = time.monotonic()
    while remaining:
        left = args.budget_s - (time.monotonic() - start)
        cmd = [sys.executable, __file__, "--worker", "--configs=" + ",".join(remaining), "--budget-s", str(int(left)),
               "--preset", args.preset, "--out", args.out, "--kernels", args.kernels, "--host-budget-gib", str(args.host_budget_gib)]
        if args.data:
            cmd += ["--data", args.data]
        rc = subprocess.call(cmd)
        done = set()
        if Path(args.out).exists():
            for line in Path(args.out).read_text().splitlines():
                row = json.loads(line)
                if row.get("summary"):
                    done.add(row["config"])
        remaining = [c for c in remaining if c not in done]
        if rc not in (0, 3):
            return rc
        if rc == 3 and remaining:
            # The configuration whose OOM did not recover is recorded without a summary: start
            # after it, with its attempts so far as its result.
            stuck = remaining.pop(0)
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps({"config": stuck, "summary": True, "longest": _best_so_far(args.out, stuck), "note": "memory not recovered after OOM"}) + "\n")
    print_table(args.out)
    return 0


def _best_so_far(path: str, name: str):
    ok = [json.loads(l)["seq_len"] for l in Path(path).read_text().splitlines() if json.loads(l).get("config") == name and json.loads(l).get("ok")]
    return max(ok) if ok else None


def print_table(path: str) -> None:
    rows = [json.loads(l) for l in Path(path).read_text().splitlines()]
    summaries = {r["config"]: r for r in rows if r.get("summary")}
    base = summaries.get("baseline", {}).get("longest")
    print(f"{'config':22s} {'longest':>8s} {'first OOM':>9s} {'tok/s':>9s} {'peak GiB':>9s} {'plan GiB':>9s} {'x baseline':>10s}")
    for name, s in summaries.items():
        best = s.get("longest")
        at = [r for r in rows if r.get("config") == name and r.get("ok") and r.get("seq_len") == best]
        r = at[-1] if at else {}
        ratio = f"{best / base:.0f}x" if best and base else "-"
        print(
            f"{name:22s} {format_length(best) if best else '-':>8s} {format_length(s['first_oom']) if s.get('first_oom') else '-':>9s} "
            f"{r.get('tokens_per_s', 0):9.0f} {r.get('peak_gib', 0):9.1f} {r.get('plan_gib', 0):9.1f} {ratio:>10s}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="prepared genome dir (real DNA); without it: random bases")
    p.add_argument("--preset", default="glm53-mini")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default="ablation.jsonl")
    p.add_argument("--kernels", default="fused")
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--host-budget-gib", type=float, default=0.75 * HOST_RAM_GIB)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.data and not Path(args.data).exists():
        args.data = None
    if args.worker:
        run_worker(args)
        return 0
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
