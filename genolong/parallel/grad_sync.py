"""The data-parallel gradient sync of the training loop: bucketed sums over each parameter's group.

After backward every rank holds the gradient of its own tokens' share of the step's loss (each
rank divides by the *global* valid count, docs/parallel.md). `GradientSync.reduce()` sums every
gradient over the group genolong.parallel.tensor_plan.grad_reduce_group names for it ("grad" =
dp x ep x cp for replicated parameters without tp/ep; "grad_sp" / "grad_expert" with them), so
afterwards each rank holds the gradient of the step's mean loss; `grad_norm()` is the global norm
(genolong.parallel.tensor_grads.global_grad_norm: elements split over tp / ep counted once).
genolong.parallel.tensor_grads.reduce_gradients is the reference (one all-reduce per parameter);
this is the same sum with fewer, larger collectives.

Precision: gradients are copied into fp32 buckets, summed in fp32 and written back in their own
dtype (bf16 on the GPU). A bf16 all-reduce would round after every partial sum of a ring (64
ranks: 63 roundings); in fp32 the sum is rounded once, to the same bf16 gradient a single GPU
keeps. The bucket is the only fp32 copy, `bucket_elements` at a time (64M = 256 MiB).

Under FSDP (genolong.parallel.fsdp) a sharded parameter's gradient arrives already summed over
fsdp (FSDP's reduce-scatter) as this rank's chunk; the chunk is summed over the rest of its
group ("*_shard" groups of tensor_plan; nothing left to do when that is one rank).

A parameter that has no gradient on this rank but has one on another rank of its group (an
expert that received no token) joins with zeros; one without a gradient anywhere (a frozen
indexer) stays None. Both are decided by one small all-reduce per group and step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from genolong.parallel.fsdp import is_sharded, local
from genolong.parallel.tensor_grads import global_grad_norm
from genolong.parallel.tensor_plan import grad_reduce_group

BUCKET_ELEMENTS = 64 * 2**20


class GradientSync:
    def __init__(self, model: torch.nn.Module, pmesh, bucket_elements: int = BUCKET_ELEMENTS) -> None:
        self.model = model
        self.pmesh = pmesh
        self.bucket_elements = bucket_elements
        self.groups: dict[str, list[torch.nn.Parameter]] = {}
        for name, param in model.named_parameters():
            if param.requires_grad:
                group = grad_reduce_group(name, pmesh.layout, sharded=is_sharded(param))
                if group is not None:
                    self.groups.setdefault(group, []).append(param)

    @torch.no_grad()
    def reduce(self) -> None:
        for name, params in self.groups.items():
            group = self.pmesh.group(name)
            present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
            # Over every rank, not only the ones that sum this gradient: under ep an expert slice whose
            # experts got no token this step has no gradient on its ranks while the layer's other
            # slices do; it joins as zeros (weight decay and the moments move on, as in one process).
            dist.all_reduce(present, op=dist.ReduceOp.MAX)
            live = []
            for param, anywhere in zip(params, present.tolist(), strict=True):
                if not anywhere:
                    continue
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                live.append(param)
            for bucket in self._buckets(live):
                self._sum(bucket, group)

    def grad_norm(self, whole_norm: Callable[[], float]) -> float:
        """The global L2 norm of the summed gradients (the same number on every rank).

        Without tp or ep every rank holds every summed gradient whole, so the norm is this rank's
        `whole_norm()` (the optimizer's, no collective: a one-rank run matches the one-process
        loop bit for bit); with them, the parts are added up over their groups."""
        layout = self.pmesh.layout
        if layout.tp == 1 and layout.ep == 1 and layout.fsdp == 1:
            return whole_norm()
        return global_grad_norm(self.model, self.pmesh)

    def _buckets(self, params: list[torch.nn.Parameter]) -> list[list[torch.Tensor]]:
        """Flat views of the gradients, packed into buckets of at most `bucket_elements` (a larger
        gradient is cut into pieces, so no fp32 copy is ever larger than one bucket)."""
        buckets: list[list[torch.Tensor]] = []
        current: list[torch.Tensor] = []
        size = 0
        for param in params:
            if not local(param.grad).is_contiguous():
                param.grad = param.grad.contiguous()
            flat = local(param.grad).view(-1)
            for start in range(0, flat.numel(), self.bucket_elements):
                piece = flat[start : start + self.bucket_elements]
                if current and size + piece.numel() > self.bucket_elements:
                    buckets.append(current)
                    current, size = [], 0
                current.append(piece)
                size += piece.numel()
        if current:
            buckets.append(current)
        return buckets

    @staticmethod
    def _sum(pieces: list[torch.Tensor], group) -> None:
        flat = torch.empty(sum(p.numel() for p in pieces), dtype=torch.float32, device=pieces[0].device)
        offset = 0
        for piece in pieces:
            flat[offset : offset + piece.numel()].copy_(piece)
            offset += piece.numel()
        dist.all_reduce(flat, group=group)
        offset = 0
        for piece in pieces:
            piece.copy_(flat[offset : offset + piece.numel()])
            offset += piece.numel()

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}: {len(params)} parameters" for name, params in self.groups.items())
        return f"GradientSync(sum in fp32 buckets of {self.bucket_elements:,} elements; {sizes})"
