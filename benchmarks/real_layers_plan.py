"""`genolong plan`'s figure for each cell of bench_real_layers.py: what the plan says a single
GLM-5.3-Flash sublayer holds during the backward of its recompute, at the cell's shape, length and
tensor / expert parallel slice (CPU only; no torch.cuda).

The plan (genolong/train/plan.py, docs/parallel.md "The plan") counts one decoder layer's working
set under full recompute as its saved items (`layer_saved_items` per token x the tokens one GPU
holds, plus the layout's own items, `layer_parallel_items`) + the gradient coming in + its backward
peak: the largest set of gradients one node makes while those items are held (`backward_peaks`),
and beside it the largest op workspace (`_transients`). A cell runs one part of a layer, and its
measured working set is the part's own backward, so its figure is that rule applied to the part:

    plan = the part's saved items + its input's bytes (the gradient coming in)
           + the largest of the part's backward peaks and its own workspaces

with every term taken from the plan's code for the real preset (`glm53_flash()`, not the cell's
sliced copy) under the cell's layout:

| cell | layer (plan) | layout, sequence | part |
|---|---|---|---|
| kda8 / kda64 | 0 (KDA) | tp=8 / 1 process, S | the `kda *` items; of the tp-held item, f_a / g_a's outputs |
| dsa8 / dsa64 | 3 (DSA) | tp=8 / 1 process, S | the `dsa *` items; of the tp-held item, the latent norms and gathered selections |
| mlp | 0 (dense) | tp=8, S | `dense mlp` |
| moe36 / moe144 / moe288 | 3 (MoE) | ep=8 at S/8 tokens / ep=2 at S/2, skew 1 / 1 process, S | the `moe *` items (+ busiest-rank rows, 0 at skew 1) |
| mhc | 0 | 1 process, S | `mhc *`, `mixer out + streams`, `mlp out` |

What the cells do not run is left out of their figure, by name in `excluded`: the sublayer's own
input (the cell's input tensor, allocated before the measurement; the tp-held item's gathered
sublayer inputs are such inputs), the RMSNorms (no cell runs them), and at ep=8 the dispatch
buffers (the cell computes its 36 experts with no all-to-all; at ep=2 its 144). The MoE runs unchunked in every
cell, so the plan is asked for a run without MoE chunking. Under tp the cell runs the rank's heads
over the whole shard (S tokens), as the plan's tokens per GPU say: Ts = S / tp tokens with every
head, Tc = S for what every tp rank holds.

Cells the plan has no figure for: the dense SDPA cells (not part of the model), the indexer cells
(forward-only selections: the plan's "indexer query chunk" transient) and "mhc compiled" (the same
items as mhc, whose uncompiled fused form is the one compared).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from genolong.model.config import MLP_DENSE, MLP_MOE
from genolong.model.presets import glm53_flash
from genolong.parallel.layout import parse_layout
from genolong.train.options import MemoryOptions
from genolong.train.plan import (
    GIB,
    STREAMS_TWO_PATHS,
    _moe,
    _transients,
    backward_peaks,
    layer_saved_items,
    moe_chunks_checkpointed,
    stored_input_bytes_per_token,
)
from genolong.train.plan_parallel import ParallelSetup, layer_parallel_items, tokens_per_gpu

TP_HELD = "held for the whole shard by each tp rank"
DISPATCH = "moe dispatch buffers (ep)"
# The within-this-fraction check of measured / plan.
TOLERANCE = 0.10


@dataclass(frozen=True)
class CellPlan:
    layer: int  # the layer of glm53_flash() whose items the cell's part is
    part: str  # "kda", "dsa", "dense", "moe", "mhc"
    layout: str  # --parallel of the slice the cell runs
    tokens_over: int = 1  # the plan's sequence is S / tokens_over (moe36: each ep rank's own tokens)


CELLS: dict[str, CellPlan] = {
    "kda8": CellPlan(0, "kda", "tp=8"),
    "kda64": CellPlan(0, "kda", ""),
    "dsa8": CellPlan(3, "dsa", "tp=8"),
    "dsa64": CellPlan(3, "dsa", ""),
    "mlp": CellPlan(0, "dense", "tp=8"),
    "moe36": CellPlan(3, "moe", "ep=8", tokens_over=8),
    "moe144": CellPlan(3, "moe", "ep=2", tokens_over=2),
    "moe288": CellPlan(3, "moe", ""),
    "mhc": CellPlan(0, "mhc", ""),
}

# Which part of a layer each of the plan's per-token items belongs to; None: no cell runs it.
# (tests/benchmarks/test_real_layers_plan.py fails when the plan gains an item not named here.)
ITEM_PART: dict[str, str | None] = {
    "kda conv (fp32)": "kda",
    "kda gates": "kda",
    "kda op inputs": "kda",
    "kda out norm": "kda",
    "kda op internals": "kda",
    "dsa projections": "dsa",
    "dsa latent q/out": "dsa",
    "dsa top-k indices": "dsa",
    "dsa op internals": "dsa",
    "dense mlp": "dense",
    "moe router": "moe",
    "moe routed": "moe",
    "moe shared": "moe",
    "mhc mixing": "mhc",
    "mhc sinkhorn": "mhc",
    "mixer out + streams": "mhc",
    "mlp out": "mhc",
    "norms": None,
}

# Which part each of the plan's backward peaks (genolong.train.plan.backward_peaks) belongs to.
PEAK_PART: dict[str, str] = {
    STREAMS_TWO_PATHS: "mhc",
    "kda conv gradients (fp32)": "kda",
    "moe gate/up gradient": "moe",
    "mlp swiglu gradients": "dense",
}

# The transients that live inside the part's own backward. The indexer's query chunk does not:
# under recompute with kept results (the training's default) the DSA recompute replays the
# forward's selection instead of running the indexer again (genolong.train.keep).
PART_TRANSIENTS: dict[str, tuple[str, ...]] = {
    "kda": ("kda chunk states",),
    "dsa": ("dsa attention workspace",),
    "dense": (),
    "moe": ("moe chunk", "moe op chunk", "moe expert weight gradients (chunk sums)"),
    "mhc": (),
}


def plan_options() -> MemoryOptions:
    """The plan's options for a cell: the training defaults with the MoE unchunked (as every cell runs it)."""
    return MemoryOptions(moe_chunking=False)


def plan_cell(cell: str, seq: int, dtype_bytes: int = 2) -> dict:
    """The plan's figure for `cell` at `seq` tokens (module docstring): bytes by term, and GiB."""
    if cell not in CELLS:
        raise KeyError(f"no plan figure for cell {cell!r}; cells with one: {', '.join(CELLS)}")
    spec = CELLS[cell]
    config, a, opts = glm53_flash(), dtype_bytes, plan_options()
    setup = ParallelSetup(layout=parse_layout(spec.layout), moe_skew=1.0)
    seq_len = seq // spec.tokens_over
    t = tokens_per_gpu(seq_len, 1, setup.layout)
    moe_chunked = moe_chunks_checkpointed(t.seq, opts)
    per_token = layer_saved_items(config, spec.layer, a, moe_chunked, mhc_fp32_input=not opts.mhc_low_precision)
    items = {k: v * t.seq for k, v in per_token.items() if ITEM_PART[k] == spec.part}
    excluded = {k: v * t.seq for k, v in per_token.items() if ITEM_PART[k] != spec.part}

    moe_routed = _moe(config, a)["moe routed"] if config.moe_layers else 0
    parallel = layer_parallel_items(config, spec.layer, setup, t, a, moe_chunked, moe_routed)
    h = config.hidden
    if TP_HELD in parallel:
        # The gathered sublayer inputs (the mixer's, and the dense MLP's or shared expert's) are the
        # cells' inputs; what is left of the item is the mixer's own (f_a / g_a, latent norms, selections).
        mlp = config.mlp_types[spec.layer]
        gathered = 1 + (mlp == MLP_DENSE or (mlp == MLP_MOE and config.moe.num_shared_experts > 0))
        inputs = gathered * a * h * (t.shard - t.seq)
        held = parallel.pop(TP_HELD)
        excluded["tp-gathered sublayer inputs"] = inputs
        if spec.part in ("kda", "dsa"):
            items[f"{spec.part} {TP_HELD}"] = held - inputs
        else:
            excluded[f"mixer's {TP_HELD}"] = held - inputs
    if DISPATCH in parallel:
        excluded[DISPATCH] = parallel.pop(DISPATCH)
    for name, value in parallel.items():
        if name.startswith(spec.part):  # the layout's items are named by their part (moe rows, dsa latent, kda cp)
            items[name] = value
        else:
            excluded[name] = value

    if spec.part == "mhc":
        input_bytes = stored_input_bytes_per_token(config, a) * t.seq  # the streams
    elif spec.part == "moe":
        input_bytes = a * h * t.seq  # the rank's own tokens
    else:
        input_bytes = a * h * t.shard  # a tp rank's mixer / MLP reads the gathered shard
    transients = _transients(config, t, opts, a, setup)
    peaks = {k: v * t.seq for k, v in backward_peaks(config, spec.layer, a, moe_chunked).items() if PEAK_PART[k] == spec.part}
    peaks.update({k: transients[k] for k in PART_TRANSIENTS[spec.part] if k in transients})
    peak_name = max(peaks, key=peaks.get) if peaks else None
    terms = {
        "saved items": sum(items.values()),
        "gradient in": input_bytes,
        "backward peak": peaks[peak_name] if peak_name else 0,
    }
    total = sum(terms.values())
    return {
        "cell": cell,
        "seq": seq,
        "layer": spec.layer,
        "layout": spec.layout or "1 process",
        "tokens": dataclasses.asdict(t),
        "items": items,
        "excluded": excluded,
        "peak": peak_name,
        "terms": terms,
        "bytes": total,
        "gib": total / GIB,
    }


def compare(measured_gib: float, plan_gib: float) -> dict:
    """The JSON fields beside a measured working set."""
    ratio = measured_gib / plan_gib
    return {
        "plan_gib": round(plan_gib, 3),
        "measured_gib": round(measured_gib, 3),
        "measured_over_plan": round(ratio, 3),
        "within_10pct": abs(ratio - 1.0) <= TOLERANCE + 1e-9,  # (1.1 itself is within)
    }
