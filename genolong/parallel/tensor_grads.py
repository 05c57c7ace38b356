"""Gradients of a tp / ep model: the per-parameter sums over their groups, and the global norm.

`reduce_gradients` is the plain reference of the data-parallel gradient sync for these layouts:
one all-reduce (sum) per parameter over `tensor_plan.grad_reduce_group` (the training loop's
bucketed or sharded sync must give the same sums). A parameter without a gradient on this rank
but with one on another rank of its group (experts that received no token) counts as zeros, so
every rank joins every collective; one without a gradient anywhere (frozen) stays None.

`global_grad_norm` counts each element of the model once: the squares of tensors split over tp
or ep are summed over that group, those of FSDP chunks over its "shard" group, replicated tensors are
counted on every rank as they are.
Call it after the sync (then every rank gets the same norm).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from genolong.parallel.fsdp import is_sharded, local
from genolong.parallel.tensor_plan import grad_reduce_group, shard_group


@torch.no_grad()
def reduce_gradients(model: torch.nn.Module, pmesh) -> None:
    layout = pmesh.layout
    by_group: dict[str, list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            group = grad_reduce_group(name, layout, sharded=is_sharded(param))
            if group is not None:
                by_group.setdefault(group, []).append(param)
    for name, params in by_group.items():
        group = pmesh.group(name)
        # Which parameters have a gradient on some rank (a frozen one, e.g. the DSA indexer, has
        # none anywhere and stays None): one small all-reduce instead of a collective per tensor.
        device = params[0].device
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
        # Over every rank (an idle expert slice under ep has none where the layer's others have one).
        dist.all_reduce(present, op=dist.ReduceOp.MAX)
        for param, any_rank in zip(params, present.tolist(), strict=True):
            if not any_rank:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(local(param.grad), group=group)


@torch.no_grad()
def global_grad_norm(model: torch.nn.Module, pmesh) -> float:
    layout = pmesh.layout
    params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    device = params[0][1].grad.device if params else torch.device("cpu")
    squares = {(group, sharded): torch.zeros((), dtype=torch.float32, device=device) for group in (None, "tp", "ep") for sharded in (False, True)}
    for name, param in params:
        grad = local(param.grad)
        squares[shard_group(name, layout), is_sharded(param)] += torch.linalg.vector_norm(grad, dtype=torch.float32).square()
    if layout.fsdp > 1:
        chunks = torch.stack([squares[group, True] for group in (None, "tp", "ep")])
        dist.all_reduce(chunks, group=pmesh.group("shard"))
        for i, group in enumerate((None, "tp", "ep")):
            squares[group, False] += chunks[i]
    for group in ("tp", "ep"):
        if pmesh.size(group) > 1:
            dist.all_reduce(squares[group, False], group=pmesh.group(group))
    return math.sqrt(float(sum(squares[group, False] for group in (None, "tp", "ep"))))
