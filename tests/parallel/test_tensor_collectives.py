"""gather_along_replicated against whole-tensor arithmetic: all-gather forward, own slice of the gradient back."""

import torch

from genolong.parallel import collectives as C
from tests.parallel.harness import run_ranks


def _check(rank, world):
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 4 * world, 3, generator=g, dtype=torch.float64)
    upstream = torch.randn(2, 4 * world, 3, generator=g, dtype=torch.float64)
    x = full.chunk(world, 1)[rank].clone().requires_grad_()
    y = C.gather_along_replicated(x, 1, None)
    # Every rank repeats the same computation on the whole tensor (as the loss after the last
    # sequence-parallel layer does): the gradient of each shard is its slice, not a sum over ranks.
    (y * upstream).sum().backward()
    return torch.equal(y, full), torch.equal(x.grad, upstream.chunk(world, 1)[rank])


def test_gather_along_replicated_on_two_ranks():
    assert run_ranks(_check, 2) == [(True, True)] * 2
