"""Single GLM-5.3-Flash layers at the real model's shapes on one GPU, and what a 64-GPU 1M-token step
would cost per GPU from them.

    source .device/activate.sh && python benchmarks/bench_real_layers.py --out $OUT/real_layers --budget-s 200

Random weights (normal, std 0.02), bf16, every hot op on its fused kernel (policy "fused"),
forward + backward at 64k and 128k tokens (B = 1):

| cell | what |
|---|---|
| kda64 / kda8 | a KDA layer, 64 heads x 128 (the model) / 8 heads (what tp=8 leaves per GPU) |
| dsa64 / dsa8 | a DSA layer, 64 heads, its 32-head indexer / 8 heads, a 4-head indexer (tp=8) |
| moe288 | the MoE block: 288 experts top-8, expert width 2048, one shared expert |
| moe36 | expert parallelism over 8 GPUs: 36 local experts receiving T (token, expert) pairs (T/8 tokens top-8) |
| mlp | the dense SwiGLU MLP of layers 0-2 at tp=8 (intermediate 12288 / 8) |
| mhc | both mHC sublayers of a layer (weights, Sinkhorn, collapse, expand), hidden 4096: the fused passes under the fused policy (eager before 2026-12-01 22:40 UTC); and compiled |
| sdpa-kda64 / sdpa-kda8 | dense causal SDPA (FlashAttention) at the KDA heads: 64 or 8 heads x 128 |
| sdpa-dsa64 / sdpa-dsa8 | dense causal SDPA at the DSA heads: 64 or 8 heads, q/k 256, v 256 |
| idx-cp8-r7 | the 4-head indexer of one context-parallel rank of a 1M sequence: 128k queries at offset 7 x 128k (the last rank, the most pools) against the whole sequence's 256k pools |

Per cell: forward ms (with grad enabled, as training runs it), forward + backward ms, TFLOP/s of
forward + backward, peak GiB above the inputs and weights. FLOPs (genolong/train/flops.py,
matmul = 2mkn): layers at 3x their forward (the indexer 1x: no gradient); causal SDPA
fwd + bwd = 3.5 x T^2 H (Dqk + Dv) (forward T^2 H (Dqk + Dv) for the causal half, backward
2.5x forward, FlashAttention's convention). A cell that runs out of memory, or would start
after the time budget, is recorded as not run, with the reason. Results append to
<out>/real_layers.jsonl as they are measured; the table and the estimate print last.

Beside `genolong plan` (docs/parallel.md, "The per-layer figures against one GPU"): every cell the
plan has a figure for (benchmarks/real_layers_plan.py: kda8/64, dsa8/64, mlp, moe36/288, mhc) runs
once more under the training's checkpoint (the DSA layer with its results kept, as the training
keeps them) and its row gets the recompute working set (`recompute_working_set`: peak allocated in
that backward above what the checkpointed forward left allocated, weight gradients out) beside the
plan's figure for the same shape, length and slice: plan_gib, measured_gib, measured_over_plan,
within_10pct, and the plan's terms and items. A "calibrate" row measures a call whose working set
is known exactly first. `--plan-check` runs only those cells (groups tp8, moe36, mlp, mhc unless
--groups says otherwise; the tp=8 layers last, since without kernel caches fla's KDA autotuning
took ~165 s for kda8 on the H200, 2026-12-02); `--dry-run` prints the plan's figures without a
GPU; `--no-plan` skips the comparison.

The per-GPU step estimate for one 1M-token sequence on 64 GPUs (cp = 8 x tp = 8, ep = 8 for the
MoE) is compute only (no all-to-all, all-reduce or expert dispatch; perfect balance), with
full-layer recompute (one more forward per layer):
  34 x (kda8 fwd+bwd + fwd) + 11 x (dsa8 fwd+bwd + fwd + (idx-cp8-r7 - the 4-head indexer
  at 128k)) + 42 x (moe36 fwd+bwd + fwd) + 3 x (mlp fwd+bwd + fwd) + 45 x (mhc fwd+bwd + fwd),
(the indexer's extra once: the recompute replays the forward's selection, genolong.train.keep;
the DSA recompute forward, which no longer attends either, is still counted whole: an upper bound),
all at 128k tokens per GPU (each cp rank holds 128k tokens; KDA's head split gives each GPU 1
head over 1M tokens, the same work as 8 heads over 128k). The LM head and the optimizer are left
out (small at 64-way sharding).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import measure  # noqa: E402
from real_layers_plan import CELLS as PLAN_CELLS  # noqa: E402
from real_layers_plan import compare, plan_cell  # noqa: E402

import genolong.kernels as kernels  # noqa: E402
from genolong.model import ops  # noqa: E402
from genolong.model.dsa import DSAAttention  # noqa: E402
from genolong.model.kda import KimiDeltaAttention  # noqa: E402
from genolong.model.mhc import HyperConnection  # noqa: E402
from genolong.model.mlp import DenseMLP  # noqa: E402
from genolong.model.model import keeps_fp32  # noqa: E402
from genolong.model.moe import MoE  # noqa: E402
from genolong.model.presets import glm53_flash  # noqa: E402
from genolong.train import flops  # noqa: E402
from genolong.train.keep import KeptResults  # noqa: E402
from genolong.train.recompute import checkpointed  # noqa: E402

DEV = "cuda"
SIZES = {"64k": 65536, "128k": 131072}
K128 = 131072
GIB = 1 << 30


def init_(build) -> torch.nn.Module:
    """build() on the GPU (the 288-expert MoE is 29 GB in fp32: no host copy), random weights
    (std 0.02), cast to bf16 except the parameters the model keeps in fp32."""
    with torch.device(DEV):
        module = build()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
            if not keeps_fp32("." + name):
                p.data = p.data.to(torch.bfloat16)
    torch.cuda.empty_cache()  # the fp32 originals
    return module


def config(tp: int = 1, experts: int = 288, top_k: int = 8):
    """GLM-5.3-Flash with the head counts one GPU holds at tensor parallelism `tp`."""
    c = glm53_flash(num_layers=4)
    ix = dataclasses.replace(c.dsa.indexer, n_heads=c.dsa.indexer.n_heads // tp)
    return c.replace(
        kda=dataclasses.replace(c.kda, num_heads=c.kda.num_heads // tp),
        dsa=dataclasses.replace(c.dsa, num_heads=c.dsa.num_heads // tp, indexer=ix),
        moe=dataclasses.replace(c.moe, num_experts=experts, top_k=top_k),
        dense_mlp=dataclasses.replace(c.dense_mlp, intermediate_size=c.dense_mlp.intermediate_size // tp),
    )


def fwd_bwd(module, x, pick=lambda out: out):
    def fwd():
        return pick(module(x))

    def both():
        x.grad = None
        out = fwd()
        out.backward(torch.ones_like(out))

    return fwd, both


def sdpa(heads: int, dqk: int, dv: int, seq: int):
    q, k = (torch.randn(1, heads, seq, dqk, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, heads, seq, dv, device=DEV, dtype=torch.bfloat16, requires_grad=True)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both():
        out = fwd()
        out.backward(torch.ones_like(out))

    return fwd, both, 3.5 * seq * seq * heads * (dqk + dv)


@dataclasses.dataclass
class Probe:
    """What the recompute working set is measured on: `call(x)` (its output picked by `pick`), the
    parameters whose gradients it makes, and whether the recompute keeps the DSA results."""

    call: object
    x: torch.Tensor
    params: list
    pick: object = None
    keep: bool = False


def recompute_working_set(probe: Probe) -> dict:
    """The backward of `probe.call(x)` under the training's checkpoint (genolong.train.recompute;
    with `keep`, the DSA results kept on the GPU as genolong.train.keep keeps them): peak allocated
    above what is allocated after the checkpointed forward (weights, input, output, kept results),
    the incoming gradient included, the weight gradients not (the plan counts them as static,
    "gradients").

    Weight gradients start as None, as after the loop's zero_grad, and appear one by one during the
    backward, so the peak is read between them (a hook after each accumulation): `working_set` takes
    out every weight gradient that exists when an interval ends (exact when the interval's peak is
    when its weight gradients were made: a node's outputs are allocated at its peak), `upper` only
    those that existed when it began. `recompute_peak_gib`: the peak with every weight gradient."""
    pick = probe.pick or (lambda out: out)

    def forward():
        keep = KeptResults("device") if probe.keep else None
        return pick(checkpointed(probe.call, probe.x, keep=keep))

    def clear():
        probe.x.grad = None
        for p in probe.params:
            p.grad = None

    def grad_bytes() -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in probe.params if p.grad is not None)

    clear()
    out = forward()  # warm-up: the recompute's kernels (the replays with keep) compile here
    out.backward(torch.ones_like(out))
    del out
    clear()
    torch.cuda.synchronize()
    out = forward()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seen = {"before": 0, "lower": 0, "upper": 0, "raw": 0}

    def interval_ends() -> None:
        # (allocator statistics are kept on the host at allocation: no synchronisation needed)
        peak, made = torch.cuda.max_memory_allocated() - base, grad_bytes()
        seen.update(raw=max(seen["raw"], peak), lower=max(seen["lower"], peak - made),
                    upper=max(seen["upper"], peak - seen["before"]), before=made)
        torch.cuda.reset_peak_memory_stats()

    hooks = [p.register_post_accumulate_grad_hook(lambda p: interval_ends()) for p in probe.params if p.requires_grad]
    try:
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        interval_ends()
    finally:
        for hook in hooks:
            hook.remove()
    grads = grad_bytes()
    del out
    clear()
    return {"recompute_peak_gib": round(seen["raw"] / GIB, 3), "weight_grad_gib": round(grads / GIB, 3),
            "upper_gib": round(seen["upper"] / GIB, 3), "working_set": seen["lower"] / GIB}


def calibration(seq: int, hidden: int) -> tuple[Probe, float]:
    """A call whose recompute working set is known exactly: sigmoid over [seq, hidden] bf16 keeps its
    output; its backward holds the incoming gradient, that output and the gradient it returns, 3 x
    seq x hidden x 2 bytes. Measured otherwise, the method (not the plan) is wrong."""
    x = torch.randn(seq, hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    return Probe(torch.sigmoid, x, []), 3 * seq * hidden * 2 / GIB


def plan_row(name: str, seq: int, got: dict) -> dict:
    """The row's fields: the measured working set beside the plan's figure (real_layers_plan.plan_cell)."""
    plan = plan_cell(name, seq)
    return {
        "recompute_peak_gib": got["recompute_peak_gib"],
        "weight_grad_gib": got["weight_grad_gib"],
        "measured_upper_gib": got["upper_gib"],
        **compare(got["working_set"], plan["gib"]),
        "plan_terms_gib": {k: round(v / GIB, 3) for k, v in plan["terms"].items()},
        "plan_items_gib": {k: round(v / GIB, 3) for k, v in plan["items"].items()},
        "plan_peak": plan["peak"],
        "plan_layout": plan["layout"],
        "plan_tokens": plan["tokens"],
    }


class Run:
    def __init__(self, out: Path, budget_s: float, plan: bool = True, cells: set[str] | None = None):
        self.rows: list[dict] = []
        self.cells = cells  # --cells: only these run (None: every cell of the chosen groups)
        self.log = (out / "real_layers.jsonl").open("a")
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.plan = plan  # measure the recompute working set beside `genolong plan`'s figure

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def cell(self, name: str, size: str, make, reps: int):
        """make() -> (fwd, fwd_bwd, flops or None[, Probe]); records one row (or why it did not run).
        With a Probe, a cell the plan has a figure for (real_layers_plan.CELLS) also gets its
        recompute working set beside the plan's figure."""
        if self.cells is not None and name not in self.cells:
            return None
        row = {"cell": name, "size": size}
        if self.left() < 10:
            row["not_run"] = "time budget"
        else:
            try:
                fwd, both, work, *probe = make()
                fwd_ms, _ = measure(fwd, reps) if fwd is not None else (None, None)
                ms, peak = measure(both, reps)
                row.update(fwd_ms=None if fwd_ms is None else round(fwd_ms, 2), ms=round(ms, 2), peak_gib=round(peak, 2))
                if work:
                    row.update(tflops=round(work / ms / 1e9, 1))
                if probe and self.plan and name in PLAN_CELLS:
                    del fwd, both  # (their closures hold nothing the probe does not)
                    row.update(plan_row(name, SIZES[size], recompute_working_set(probe[0])))
            except torch.cuda.OutOfMemoryError as why:
                row["not_run"] = "out of memory: " + str(why).splitlines()[0][:120]
            except Exception as why:  # a kernel that failed is a result too
                row["not_run"] = f"{type(why).__name__}: {str(why)[:200]}"
                traceback.print_exc()
        return self._record(row)

    def calibrate(self, size: str) -> dict:
        """The measuring method on a call whose working set is known (`calibration`): one row."""
        row = {"cell": "calibrate", "size": size}
        try:
            probe, exact = calibration(SIZES[size], 4096)
            got = recompute_working_set(probe)
            row.update(recompute_peak_gib=got["recompute_peak_gib"], measured_upper_gib=got["upper_gib"],
                       **compare(got["working_set"], exact))
            row["plan_gib_is"] = "exact: 3 x seq x 4096 x 2 bytes (sigmoid's input gradient, output, output gradient)"
        except Exception as why:
            row["not_run"] = f"{type(why).__name__}: {str(why)[:200]}"
            traceback.print_exc()
        return self._record(row)

    def _record(self, row: dict) -> dict:
        """Keep one row: in memory, in the JSON-lines log at once (a cut run keeps it), on stdout."""
        torch.cuda.empty_cache()
        self.rows.append(row)
        self.log.write(json.dumps(row) + "\n")
        self.log.flush()
        print(json.dumps(row), f"[{self.left():.0f} s left]", flush=True)
        return row

    def ms(self, name: str, size: str = "128k", key: str = "ms"):
        for r in self.rows:
            if r["cell"] == name and r["size"] == size and r.get(key) is not None:
                return r[key]
        return None


def layer_cells(run: Run, size: str, reps: int, tp: int, plan_only: bool = False) -> None:
    """The KDA and DSA layers at tp's heads; unless plan_only, their dense SDPA and the indexer cells too."""
    seq = SIZES[size]
    c = config(tp)
    heads = c.kda.num_heads

    # DSA first: the largest part of the estimate, and kda64's first call autotunes fla for minutes.
    def dsa(c=c):
        layer = init_(lambda: DSAAttention(c.hidden, c.dsa, c.rms_eps, 3, has_indexer=True))
        x = torch.randn(1, seq, c.hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        f, b = fwd_bwd(layer, x, lambda o: o[0])
        attn, index = flops.dsa_forward(c, seq)
        # Its recompute replays the kept selection and attention, as the training's default does.
        return f, b, 3 * attn + index, Probe(layer, x, list(layer.parameters()), pick=lambda o: o[0], keep=True)

    run.cell(f"dsa{c.dsa.num_heads}", size, dsa, reps)
    if not plan_only:
        run.cell(f"sdpa-dsa{c.dsa.num_heads}", size,
                 lambda c=c: sdpa(c.dsa.num_heads, c.dsa.qk_head_dim, c.dsa.v_head_dim, seq), reps)

    def kda(c=c):
        layer = init_(lambda: KimiDeltaAttention(c.hidden, c.kda, c.rms_eps, 0))
        x = torch.randn(1, seq, c.hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        f, b = fwd_bwd(layer, x)
        return f, b, 3 * flops.kda_forward(c, seq), Probe(layer, x, list(layer.parameters()))

    run.cell(f"kda{heads}", size, kda, reps)
    if plan_only:
        return
    run.cell(f"sdpa-kda{heads}", size, lambda c=c: sdpa(c.kda.num_heads, c.kda.head_dim, c.kda.head_dim, seq), reps)

    indexer_cell(run, size, reps, c)
    if tp == 8 and size == "128k":
        indexer_cell(run, size, 2, c, offset=7 * K128, n_pools=8 * K128 // c.dsa.indexer.kpool, name="idx-cp8-r7")


# The indexer's two fused selections: v2 (pass 1 group maxima, then the candidates; the fused policy's
# choice) and v1 (two full passes), "-v1" in the cell's name.
INDEXER_IMPLS = {"v2": "triton_fused_select", "v1": "triton_two_pass"}


def indexer_cell(run: Run, size: str, reps: int, c, offset: int = 0, n_pools: int | None = None, name: str | None = None,
                 version: str = "v2"):
    seq = SIZES[size]
    ix = c.dsa.indexer
    n_pools = seq // ix.kpool if n_pools is None else n_pools
    fused = ops.implementations("dsa_indexer_topk")[INDEXER_IMPLS[version]]

    def make():
        q = (torch.randn(1, seq, ix.n_heads, ix.head_dim, device=DEV) * 0.3 + 0.2).bfloat16()
        keys = (torch.randn(1, n_pools, ix.head_dim, device=DEV) * 0.3 + 0.2).bfloat16()
        w = torch.randn(1, seq, ix.n_heads, device=DEV) * ix.n_heads**-0.5
        kw = dict(kpool=ix.kpool, topk_pools=ix.topk_pools, always_select_tail=True, softmax_scale=ix.head_dim**-0.5)
        return None, lambda: fused(q, keys, w, query_offset=offset, **kw), None

    run.cell(name or f"indexer{ix.n_heads}" + ("" if version == "v2" else "-v1"), size, make, reps)


def indexer_versions(run: Run, size: str, reps: int) -> None:
    """Both selections side by side at GLM-5.3-Flash's 32-head indexer (tp=1) and at tp=8's 4 heads."""
    for tp in (1, 8):
        for version in INDEXER_IMPLS:
            indexer_cell(run, size, reps, config(tp), version=version)


def moe_cell(run: Run, size: str, reps: int, local_experts: int) -> None:
    seq = SIZES[size]
    c = config(8 if local_experts < 288 else 1, experts=local_experts)
    # Expert parallelism over 288 / local_experts GPUs: each receives, on balanced routing, as many
    # (token, expert) pairs as T tokens top-8 would make on one GPU divided by the group size.
    tokens = seq * local_experts // 288

    def moe():
        block = init_(lambda: MoE(c.hidden, c.moe, 3))
        x = torch.randn(1, tokens, c.hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        f, b = fwd_bwd(block, x)
        return f, b, 3 * flops.mlp_forward(c, 3, tokens), Probe(block, x, list(block.parameters()))

    run.cell(f"moe{local_experts}", size, moe, reps)


def mlp_cell(run: Run, size: str, reps: int) -> None:
    seq = SIZES[size]
    c = config(8)

    def mlp():
        block = init_(lambda: DenseMLP(c.hidden, c.dense_mlp.intermediate_size, c.dense_mlp.swiglu_limit))
        x = torch.randn(1, seq, c.hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        f, b = fwd_bwd(block, x)
        return f, b, 3 * flops.mlp_forward(c, 0, seq), Probe(block, x, list(block.parameters()))

    run.cell("mlp", size, mlp, reps)


def mhc_cells(run: Run, size: str, reps: int, compiled: bool) -> None:
    from genolong.train.compile import apply_compile

    seq = SIZES[size]
    c = config(8)

    def mhc():
        hcs = [init_(lambda: HyperConnection(c.hidden, c.mhc, c.rms_eps)) for _ in range(2)]
        if compiled:
            for hc in hcs:
                apply_compile(hc)
        streams = torch.randn(1, seq, c.mhc.num_streams, c.hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        out = torch.randn(1, seq, c.hidden, device=DEV, dtype=torch.bfloat16)

        def layer(s):
            for hc in hcs:  # the layer's two sublayers, the sublayer itself replaced by a fixed output
                post, comb, x = hc(s)
                s = hc.expand(post, comb, x * out, s)
            return s

        def fwd():
            return layer(streams)

        def both():
            streams.grad = None
            s = fwd()
            s.backward(torch.ones_like(s))

        both()  # compiles (when compiled) outside the timing
        return fwd, both, 3 * flops.mhc_forward(c, seq), Probe(layer, streams, [p for hc in hcs for p in hc.parameters()])

    run.cell("mhc compiled" if compiled else "mhc", size, mhc, reps)


def estimate(run: Run) -> list[str]:
    """The per-GPU step of a 64-GPU 1M-token run (module docstring), from the 128k cells."""
    def both(name):
        total, fwd = run.ms(name), run.ms(name, key="fwd_ms")
        return None if total is None or fwd is None else total + fwd  # + fwd: full-layer recompute

    kda, dsa, moe, mlp = both("kda8"), both("dsa8"), both("moe36"), both("mlp")
    mhc = both("mhc compiled") or both("mhc")
    idx_r7, idx_128k = run.ms("idx-cp8-r7"), run.ms("indexer4")
    parts = {"34 KDA": kda, "11 DSA": dsa, "42 MoE": moe, "3 dense MLP": mlp, "45 mHC pairs": mhc, "11 indexer beyond 128k": None}
    if idx_r7 is not None and idx_128k is not None:
        # The forward's only: the recompute replays the kept selection (genolong.train.keep; it ran
        # twice before 2026-12-02). The DSA layer's recompute forward is still counted whole, although
        # it no longer runs the sparse attention or the selection (not measured apart at this shape).
        parts["11 indexer beyond 128k"] = idx_r7 - idx_128k
    counts = {"34 KDA": 34, "11 DSA": 11, "42 MoE": 42, "3 dense MLP": 3, "45 mHC pairs": 45, "11 indexer beyond 128k": 11}
    lines = ["", "Per-GPU step estimate, 1M tokens on 64 GPUs (cp=8 x tp=8, ep=8), compute only, full recompute:"]
    total, missing = 0.0, []
    for name, ms in parts.items():
        if ms is None:
            missing.append(name)
            continue
        total += counts[name] * ms
        lines.append(f"  {name:<24} {counts[name]:>3} x {ms:9.1f} ms = {counts[name] * ms / 1000:7.2f} s")
    lines.append(f"  total                                        {total / 1000:7.2f} s"
                 + (f"  (missing: {', '.join(missing)})" if missing else ""))
    return lines


GROUPS = ("tp8", "moe36", "mlp", "mhc", "tp1", "moe144", "moe288", "indexers")
DEFAULT_GROUPS = "tp8,moe36,mlp,mhc,tp1,moe288"
# The plan check's default: the slices one GPU of a 64-GPU run holds (moe288 at 128k does not fit an H100).
PLAN_CHECK_GROUPS = "tp8,moe36,mlp,mhc"
PLAN_CHECK_ORDER = ("moe36", "mlp", "mhc", "tp8", "tp1", "moe144", "moe288", "indexers")
# The cells of each group that `genolong plan` has a figure for (real_layers_plan.CELLS), in run order.
GROUP_PLAN_CELLS = {"tp8": ("dsa8", "kda8"), "moe36": ("moe36",), "mlp": ("mlp",), "mhc": ("mhc",),
                    "tp1": ("dsa64", "kda64"), "moe144": ("moe144",), "moe288": ("moe288",), "indexers": ()}


def plan_table(rows: list[dict]) -> list[str]:
    """The measured recompute working sets beside the plan's figures."""
    lines = ["", "Recompute working set vs `genolong plan` (GiB; measured = peak of the checkpointed backward "
             "above its forward, weight gradients out):",
             f"{'cell':<10} {'size':>5} | {'plan':>7} | {'measured':>8} | {'meas/plan':>9} | {'within 10%':>10} | "
             f"{'at most':>7} | {'with w.grads':>12} | plan layout, tokens per GPU (shard / seq)"]
    for r in rows:
        if "plan_gib" not in r:
            if r["cell"] in PLAN_CELLS or r["cell"] == "calibrate":
                lines.append(f"{r['cell']:<10} {r['size']:>5} | not measured: {r.get('not_run', '')}")
            continue
        where = r.get("plan_layout", "exact (method check)")
        tokens = r.get("plan_tokens")
        if tokens:
            where += f", {tokens['shard']} / {tokens['seq']}"
        lines.append(f"{r['cell']:<10} {r['size']:>5} | {r['plan_gib']:>7.2f} | {r['measured_gib']:>8.2f} | "
                     f"{r['measured_over_plan']:>9.3f} | {('yes' if r['within_10pct'] else 'NO'):>10} | "
                     f"{r['measured_upper_gib']:>7.2f} | {r['recompute_peak_gib']:>12.2f} | {where}")
    return lines


def mhc_group(run: Run, size: str, reps: int, compiled: bool) -> None:
    mhc_cells(run, size, reps, compiled=False)
    if compiled:
        mhc_cells(run, size, reps, compiled=True)


def dry_run(groups: set[str], sizes: list[str], cells: set[str] | None = None) -> None:
    """No GPU: the plan's figure for every cell the arguments would compare (real_layers_plan)."""
    print("dry run: the plan's figures only, nothing measured")
    for size in sizes:
        for group in PLAN_CHECK_ORDER:
            if group not in groups:
                continue
            for name in GROUP_PLAN_CELLS[group]:
                if cells is not None and name not in cells:
                    continue
                plan = plan_cell(name, SIZES[size])
                terms = ", ".join(f"{k} {v / GIB:.2f}" for k, v in plan["terms"].items())
                print(f"{name:<8} {size:>5} plan {plan['gib']:7.2f} GiB ({terms}; {plan['layout']}, peak {plan['peak']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/real_layers"))
    ap.add_argument("--sizes", default="128k,64k", help="the first size gets every cell before the next starts")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled mHC cell")
    ap.add_argument("--groups", default=None,
                    help="which cell groups run, in this order's subset: tp8 (kda8, dsa8, SDPA, indexers), moe36, mlp, mhc, "
                         "tp1 (kda64, dsa64 and their SDPA), moe144 (ep=2's slice), moe288, indexers (v2 and v1 selections at 32 and 4 heads); "
                         f"default {DEFAULT_GROUPS}, with --plan-check {PLAN_CHECK_GROUPS}")
    ap.add_argument("--cells", default=None,
                    help="only these of the chosen groups' cells that the plan has a figure for (e.g. dsa64,moe288: "
                         "tp1 without kda64, whose 128k does not fit an H100); no SDPA or indexer cells")
    ap.add_argument("--plan-check", action="store_true",
                    help="only the cells `genolong plan` has a figure for (no SDPA, indexer or compiled mHC cells), each with "
                         "its recompute working set beside the plan's")
    ap.add_argument("--no-plan", action="store_true", help="skip the recompute working-set measurement and the plan's figures")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: print the plan's figures for the cells the other arguments select")
    args = ap.parse_args()
    chosen = args.groups if args.groups is not None else PLAN_CHECK_GROUPS if args.plan_check else DEFAULT_GROUPS
    groups = {g.strip() for g in chosen.split(",") if g.strip()}
    unknown = groups - set(GROUPS)
    if unknown:
        ap.error(f"unknown --groups {', '.join(sorted(unknown))}")
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        ap.error(f"unknown --sizes {', '.join(bad)}: use {', '.join(SIZES)}")
    cells = None
    if args.cells is not None:
        cells = {c.strip() for c in args.cells.split(",") if c.strip()}
        known = {name for g in groups for name in GROUP_PLAN_CELLS[g]}
        if not cells or cells - known:
            ap.error(f"unknown --cells {', '.join(sorted(cells - known)) or '(none)'} for --groups {chosen}: "
                     f"use {', '.join(sorted(known))}")
    if args.plan_check and args.no_plan:
        ap.error("--plan-check measures against the plan: drop --no-plan")
    if args.dry_run:
        dry_run(groups, sizes, cells)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    kernels.load()
    ops.use("fused")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {kernels.available()}", flush=True)
    run = Run(args.out, args.budget_s, plan=not args.no_plan, cells=cells)
    if run.plan:
        run.calibrate(sizes[0])
    run_group = {
        "tp8": lambda size, reps: layer_cells(run, size, reps, tp=8, plan_only=args.plan_check),
        "moe36": lambda size, reps: moe_cell(run, size, reps, local_experts=36),
        "mlp": lambda size, reps: mlp_cell(run, size, reps),
        "mhc": lambda size, reps: mhc_group(run, size, reps, compiled=not args.no_compile and not args.plan_check),
        "tp1": lambda size, reps: layer_cells(run, size, reps, tp=1, plan_only=args.plan_check),
        "moe144": lambda size, reps: moe_cell(run, size, reps, local_experts=144),
        "moe288": lambda size, reps: moe_cell(run, size, reps, local_experts=288),
        "indexers": lambda size, reps: None if args.plan_check else indexer_versions(run, size, reps),
    }
    # What the 64-GPU estimate needs first (tp=8 shapes), then the whole model's heads. The plan check
    # runs the tp=8 layers last: on a machine without kernel caches fla's KDA autotuning takes minutes,
    # and the cells before it should not wait for it.
    order = PLAN_CHECK_ORDER if args.plan_check else GROUPS
    for size in sizes:
        reps = 2 if SIZES[size] >= K128 else 3
        for group in order:
            if group in groups:
                run_group[group](size, reps)
    print(f"\n{'cell':<14} {'size':>5} | {'fwd ms':>8} | {'fwd+bwd ms':>10} | {'TFLOP/s':>7} | {'peak GiB':>8} | note")
    for r in run.rows:
        cols = [r.get(k) for k in ("fwd_ms", "ms", "tflops", "peak_gib")]
        cols = ["-" if v is None else f"{v}" for v in cols]
        print(f"{r['cell']:<14} {r['size']:>5} | {cols[0]:>8} | {cols[1]:>10} | {cols[2]:>7} | {cols[3]:>8} | {r.get('not_run', '')}")
    lines = estimate(run)
    if run.plan:
        lines += plan_table(run.rows)
    print("\n".join(lines))
    (args.out / "estimate.txt").write_text("\n".join(lines) + "\n")
    print("kernel audit:", ops.audit_summary())


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.0f} s")
