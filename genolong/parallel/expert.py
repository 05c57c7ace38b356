"""Expert parallelism: `apply_expert_parallel(model, pmesh)` (docs/parallel.md).

Each ep rank keeps num_experts / ep routed experts (rank r: experts [r E/ep, (r+1) E/ep)); for
everything else the ep ranks are data parallel (they read different sequences). The router runs
on the rank's own tokens, as before; `ExpertParallelExperts.forward` then, per call:

1. sorts the (token, chosen expert) pairs by expert (stable), so they are grouped by the rank
   that holds the expert;
2. exchanges the per-expert counts (an int64 all-to-all of E numbers): every rank learns how
   many rows each rank sends to each of its local experts, so no expert ids travel;
3. exchanges the rows (`exchange`, an uneven all-to-all in the activations' dtype: bf16 on the
   GPU), one row per (token, chosen expert);
4. runs the "moe_experts" hot op on its local experts (expert ids re-based to 0, one expert
   per row, weight 1);
5. sends the results back by the reverse exchange and combines them at home: the sum over the
   token's k rows of (routing weight x row), in the activations' dtype (no fp32 combine buffer).

Backward runs the same two exchanges in reverse (autograd through `exchange`). The routing
weights never travel: their gradient is computed at home. The MoE's chunking (MoE over the
sequence in chunks, genolong/train/memory.py or the passes' ChunkedMoE) composes: it calls the
MoE per chunk, so tokens are dispatched per chunk and the dispatch buffers are a chunk's. All
ranks of an ep group must call the MoE the same number of times (equal chunk counts: every rank
of a layout holds the same number of tokens), as for every collective.

A rank whose experts receive no token in a call gets no gradient for them (None); sums over
the gradient group must count it as zeros (genolong.parallel.tensor_grads.reduce_gradients does).

Uneven routing (real data: the busiest rank ~4x the mean) only makes the receiving buffers
uneven; `dispatch_imbalance` reports the busiest rank's rows over the mean per layer. The
aux-free balancing (genolong/train/balance.py) counts routed tokens per expert on each rank's
own tokens; `expert_count_reducer(pmesh)` is the `reduce=` that sums them over every rank that
routes different tokens (dp x ep x cp x tp) so each rank applies the same bias update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from genolong.errors import GenolongError
from genolong.model import ops
from genolong.model.config import MLP_MOE, ModelConfig
from genolong.model.moe import Experts
from genolong.parallel.collectives import exchange, exchange_counts
from genolong.parallel.tensor_plan import REDUCE_GROUPS, canonical_group, ensure_reduce_groups, slice_parameters


class _EPGroup:
    def __init__(self, group, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def __repr__(self) -> str:
        return f"ep rank {self.rank} of {self.size}"


class ExpertParallelExperts(Experts):
    """This ep rank's slice of the routed experts, fed by all-to-all token dispatch (module docstring)."""

    ep: _EPGroup
    rows_received: int

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        n_tokens, k = topk_idx.shape
        ep, n_local = self.ep, self.gate_up_proj.shape[0]
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=n_local * ep.size)
        arriving = exchange_counts(per_expert, ep.group).view(ep.size, n_local)  # [source rank, local expert]
        send = per_expert.view(ep.size, n_local).sum(1).tolist()
        recv = arriving.sum(1).tolist()
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward
            self.rows_received += sum(recv)

        rows = exchange(x[order // k], send, recv, ep.group)
        local_ids = torch.repeat_interleave(torch.arange(n_local, device=x.device).repeat(ep.size), arriving.flatten())
        out = self._local_experts(rows, local_ids)
        back = exchange(out, recv, send, ep.group)

        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        slots = back.index_select(0, inverse).view(n_tokens, k, -1)
        return (slots * topk_w.to(x.dtype).unsqueeze(-1)).sum(1)

    def _local_experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 0:
            # Still a function of `rows`, so the reverse exchange's backward reaches the forward
            # exchange's on this rank too (every rank must join both collectives); and of the
            # weights, so they get a zero gradient rather than none: FSDP's reduce-scatter needs
            # the same gradients on every rank of its group.
            return rows * 0 + (self.gate_up_proj.sum() + self.down_proj.sum()).to(rows.dtype) * 0
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return ops.call(
            "moe_experts",
            self.layer_idx,
            rows,
            local_ids.unsqueeze(1),
            ones,
            self.gate_up_proj,
            self.down_proj,
            swiglu_limit=self.swiglu_limit,
        )

    def extra_repr(self) -> str:
        first = self.ep.rank * self.gate_up_proj.shape[0]
        return f"{self.ep}, experts {first}..{first + self.gate_up_proj.shape[0] - 1}, all-to-all dispatch"


def apply_expert_parallel(model: nn.Module, pmesh) -> nn.Module:
    """Keep this ep rank's routed experts and dispatch tokens to them (module docstring); a no-op at
    ep=1. Collective: call on every rank. Composes with apply_tensor_parallel in either order."""
    size = pmesh.size("ep")
    if size == 1:
        return model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if any(isinstance(m, ExpertParallelExperts) for m in experts):
        raise GenolongError("expert parallelism is already applied to this model; apply it once, to the plain model")
    check_expert_parallel(_config(model), pmesh.layout)
    ensure_reduce_groups(pmesh)
    ep = _EPGroup(pmesh.group("ep"), pmesh.rank("ep"), size)
    slice_parameters(model, "ep", ep.rank, ep.size)
    for module in experts:
        module.__class__ = ExpertParallelExperts
        module.ep = ep
        module.rows_received = 0
    return model


def check_expert_parallel(config, layout) -> None:
    """Raise a one-line GenolongError if `config` (a ModelConfig) cannot run at `layout`'s ep."""
    if layout.ep == 1:
        return
    if MLP_MOE not in config.mlp_types:
        raise GenolongError(f"--parallel ep={layout.ep}: this model has no MoE layer to split; drop ep")
    total = config.moe.num_experts
    if total % layout.ep:
        raise GenolongError(f"--parallel ep={layout.ep}: the model's {total} routed experts do not split evenly; use an ep that divides {total}")


def _config(model: nn.Module):
    configs = [m.config for m in model.modules() if isinstance(getattr(m, "config", None), ModelConfig)]
    if not configs:
        raise GenolongError("apply_expert_parallel expects a GenoLongForCausalLM / GenoLongModel")
    return configs[0]


def routing_group(pmesh) -> str:
    """The group of every rank that routes different tokens (dp x ep x cp x tp)."""
    return canonical_group(REDUCE_GROUPS["grad_sp"], pmesh.layout)


def expert_count_reducer(pmesh):
    """`reduce=` for ExpertBalancer.finish_step: sums the stacked [layers, E] token counts over
    `routing_group` (in place on a copy; returns the global counts)."""
    group = pmesh.group(routing_group(pmesh))

    def reduce(counts: torch.Tensor) -> torch.Tensor:
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
        return counts

    return reduce


def dispatch_imbalance(model: nn.Module, pmesh, *, reset: bool = True) -> dict[int, float]:
    """Per MoE layer: rows received by the busiest ep rank over the mean rows per ep rank, since
    the last reset (1.0 is perfect balance). Collective over the "ep" group."""
    experts = sorted((m for m in model.modules() if isinstance(m, ExpertParallelExperts)), key=lambda m: m.layer_idx)
    if not experts:
        return {}
    mine = torch.tensor([float(m.rows_received) for m in experts], device=experts[0].gate_up_proj.device)
    every = [torch.empty_like(mine) for _ in range(pmesh.size("ep"))]
    dist.all_gather(every, mine, group=pmesh.group("ep"))
    rows = torch.stack(every)  # [ep rank, layer]
    mean = rows.mean(0).clamp_min(1e-12)
    if reset:
        for m in experts:
            m.rows_received = 0
    ratio = (rows.max(0).values / mean).cpu()
    return {m.layer_idx: float(ratio[i]) for i, m in enumerate(experts)}
