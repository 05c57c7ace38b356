"""Each collective and its gradient against the same arithmetic done on the whole tensors in one process."""

import torch

from genolong.parallel import collectives as C
from tests.parallel.harness import run_ranks


def _full(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check(rank, world):
    group = None  # the world
    n = world
    out = {}

    # gather_along: every rank sees all shards; each shard's gradient is the sum of all ranks' upstream grads.
    xs = [_full(10 + r, 3, 2 * 1, 5) for r in range(n)]
    ws = [_full(20 + r, 3, 2 * n, 5) for r in range(n)]
    x = xs[rank].clone().requires_grad_()
    y = C.gather_along(x, 1, group)
    (y * ws[rank]).sum().backward()
    out["gather"] = torch.equal(y, torch.cat(xs, 1))
    out["gather_grad"] = torch.allclose(x.grad, sum(w for w in ws).chunk(n, 1)[rank])

    # scatter_sum_along: rank r keeps shard r of the sum; the gradient of x is every rank's upstream grad, gathered.
    xs = [_full(30 + r, 4 * n, 3) for r in range(n)]
    ws = [_full(40 + r, 4, 3) for r in range(n)]
    x = xs[rank].clone().requires_grad_()
    y = C.scatter_sum_along(x, 0, group)
    (y * ws[rank]).sum().backward()
    out["scatter"] = torch.allclose(y, sum(xs).chunk(n, 0)[rank])
    out["scatter_grad"] = torch.allclose(x.grad, torch.cat(ws, 0))

    # all_to_all_along: sequence shards of [T, H, D] -> head shards of the whole sequence, and back.
    full = _full(50, 4 * n, 2 * n, 3)
    x = full.chunk(n, 0)[rank].clone().requires_grad_()
    heads = C.all_to_all_along(x, 1, 0, group)
    out["ulysses"] = torch.equal(heads, full.chunk(n, 1)[rank])
    back = C.all_to_all_along(heads, 0, 1, group)
    out["ulysses_back"] = torch.equal(back, x.detach())
    w = _full(60, 4 * n, 2 * n, 3)
    (heads * w.chunk(n, 1)[rank]).sum().backward()
    out["ulysses_grad"] = torch.equal(x.grad, w.chunk(n, 0)[rank])

    # exchange: uneven rows; rank r sends r + 1 + s rows to rank s.
    send = [rank + 1 + s for s in range(n)]
    recv = C.exchange_counts(torch.tensor(send), group).tolist()
    out["counts"] = recv == [r + 1 + rank for r in range(n)]
    x = (torch.arange(sum(send), dtype=torch.float64) + 100 * rank).unsqueeze(1).requires_grad_()
    y = C.exchange(x, send, recv, group)
    expect = []
    for r in range(n):
        start = sum(r + 1 + s for s in range(rank))
        expect += [100 * r + start + i for i in range(r + 1 + rank)]
    out["exchange"] = y.squeeze(1).tolist() == expect
    (y * 2).sum().backward()
    out["exchange_grad"] = torch.equal(x.grad, torch.full_like(x, 2.0))

    # reduce_sum / copy_to: the TP pair.
    x = _full(70 + rank, 5).requires_grad_()
    y = C.reduce_sum(x, group)
    (y * (rank + 1)).sum().backward()
    out["reduce"] = torch.allclose(y, sum(_full(70 + r, 5) for r in range(n)))
    out["reduce_grad"] = torch.equal(x.grad, torch.full_like(x, rank + 1.0))
    x = _full(80, 5).requires_grad_()
    (C.copy_to(x, group) * (rank + 1)).sum().backward()
    out["copy_grad"] = torch.equal(x.grad, torch.full_like(x, sum(r + 1.0 for r in range(n))))
    return out


def test_collectives_and_their_gradients_on_two_ranks():
    for got in run_ranks(_check, 2):
        assert all(got.values()), got


def test_collectives_and_their_gradients_on_three_ranks():
    for got in run_ranks(_check, 3):
        assert all(got.values()), got


def _fails_on_every_rank(rank, world_size):
    import time

    if rank == 1:
        time.sleep(1)  # the cause arrives after its symptom
        raise ValueError("the cause, on rank 1")
    raise RuntimeError("a symptom, on rank 0")


def test_the_harness_reports_every_failed_rank_not_only_the_first():
    import pytest

    with pytest.raises(AssertionError) as failed:
        run_ranks(_fails_on_every_rank, 2)
    assert "the cause, on rank 1" in str(failed.value) and "a symptom, on rank 0" in str(failed.value)
