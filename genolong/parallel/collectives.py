"""Collectives with autograd: what the parallel wrappers exchange, and the gradient each sends back.

Every function takes a process group and works on one dimension of a tensor. Each forward
collective has the adjoint collective as its backward, so a wrapper can gather what it needs
and leave the gradient bookkeeping to autograd:

| forward                          | backward                          | used by                       |
|----------------------------------|-----------------------------------|-------------------------------|
| `gather_along` (all-gather)      | reduce-scatter (sum)              | CP: latent / pooled keys; SP  |
| `gather_along_replicated` (all-gather) | this rank's slice (no sum)  | SP: the final hidden states   |
| `scatter_sum_along` (reduce-scatter) | all-gather                    | SP: row-parallel outputs      |
| `all_to_all_along` (swap dims)   | the inverse all-to-all            | Ulysses head split            |
| `reduce_sum` (all-reduce)        | identity                          | TP: row-parallel without SP   |
| `copy_to` (identity)             | all-reduce                        | TP: column-parallel inputs    |
| `exchange` (uneven all-to-all)   | the reverse exchange              | EP: token dispatch / combine  |
| `from_previous_rank` (halo)      | sent back to the previous rank    | CP: the KDA short conv's halo |

Shards along `dim` are equal-sized except in `exchange`. Tensors are made contiguous with the
gathered dimension outermost before a collective, because NCCL and gloo move flat buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the flat-buffer collectives; the H200 machine runs torch 2.11.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group) -> int:
    return dist.get_world_size(group)


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0], *front.shape[1:]))
    _all_gather_flat(out, front, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce-scatter of dim {dim} (size {x.shape[dim]}) over {n} ranks needs equal shards")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
    _reduce_scatter_flat(out, front, group=group)
    return out.movedim(0, dim)


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split x into n pieces along scatter_dim, send piece r to rank r, concatenate what arrives along gather_dim."""
    n = _size(group)
    if n == 1:
        return x
    if x.shape[scatter_dim] % n:
        raise ValueError(f"all-to-all of dim {scatter_dim} (size {x.shape[scatter_dim]}) over {n} ranks needs equal pieces")
    pieces = x.movedim(scatter_dim, 0).contiguous()  # piece r = rows [r * m, (r + 1) * m)
    out = torch.empty_like(pieces)
    dist.all_to_all_single(out, pieces, group=group)
    m = pieces.shape[0] // n
    received = out.unflatten(0, (n, m)).movedim(1, scatter_dim + 1)  # [n, ...x with scatter dim m...]
    return torch.cat(received.unbind(0), dim=gather_dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        n = _size(ctx.group)
        return grad.chunk(n, ctx.dim)[dist.get_rank(ctx.group)].contiguous(), None, None


class _ScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class _ReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        if _size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if _size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _FromPrevious(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _neighbour(x, group, step=-1)

    @staticmethod
    def backward(ctx, grad):
        return _neighbour(grad, ctx.group, step=+1), None


def _neighbour(x: torch.Tensor, group, step: int) -> torch.Tensor:
    """The x of rank (this rank + step), zeros where that rank does not exist. An all-gather
    underneath: meant for halos of a few tokens, where a collective beats two point-to-point calls."""
    n = _size(group)
    if n == 1:
        return torch.zeros_like(x)
    everyone = _all_gather(x.unsqueeze(0), 0, group)  # every rank takes part, even one that keeps nothing
    source = dist.get_rank(group) + step
    return everyone[source].contiguous() if 0 <= source < n else torch.zeros_like(x)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return _exchange(x, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return _exchange(grad, recv_counts, send_counts, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts), group=group)
    return out


def gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All ranks' equal shards of `dim`, concatenated in rank order; the gradient is reduce-scattered back."""
    return _Gather.apply(x, dim, group)


def gather_along_replicated(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All ranks' equal shards of `dim`, for a computation every rank then repeats identically (the
    loss after the last sequence-parallel layer): each rank's incoming gradient is already the
    whole one, so the backward keeps this rank's slice instead of summing over ranks."""
    return _GatherReplicated.apply(x, dim, group)


def scatter_sum_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The sum over ranks of x, of which each rank keeps its shard of `dim`; the gradient is all-gathered."""
    return _ScatterSum.apply(x, dim, group)


def all_to_all_along(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Give away shards of `scatter_dim`, receive the group's shards of `gather_dim` (Ulysses' swap)."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward: the output of a row-parallel product."""
    return _ReduceSum.apply(x, group)


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward, all-reduce (sum) backward: the input of a column-parallel product."""
    return _CopyTo.apply(x, group)


def from_previous_rank(x: torch.Tensor, group) -> torch.Tensor:
    """The previous rank's x (zeros on the first rank); every rank must pass the same shape. The
    gradient goes back to the rank that sent it (context parallelism: the short conv's halo)."""
    return _FromPrevious.apply(x, group)


def exchange(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """Uneven all-to-all of rows: send_counts[r] rows of x (in order) go to rank r, recv_counts[r] arrive from it."""
    return _Exchange.apply(x, list(send_counts), list(recv_counts), group)


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """What every rank will send to this one, given what this one sends to each (an int64 all-to-all)."""
    send_counts = send_counts.to(torch.int64).contiguous()
    if _size(group) == 1:
        return send_counts.clone()
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv
