"""genolong/model/mhc_eager.py against the references in genolong/model/mhc_math.py: values and gradients."""

import pytest
import torch

from genolong.model import mhc_eager, mhc_math


def _comb(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g, dtype=dtype) * 2, -1) + 1e-6


@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("shape", [(2, 7, 4, 4), (5, 3, 3)])
def test_sinkhorn_values_and_gradients_equal_the_reference_in_float64(iters, shape):
    x = _comb(shape, torch.float64)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = mhc_eager.sinkhorn(a, iters, 1e-6), mhc_math.sinkhorn(b, iters, 1e-6)
    (out * dy).sum().backward()
    (ref * dy).sum().backward()
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-11, atol=1e-12)


def test_sinkhorn_gradcheck():
    x = _comb((3, 4, 4), torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: mhc_eager.sinkhorn(t, 5, 1e-6), (x,))


def test_sinkhorn_float32_matches_the_reference_to_rounding():
    x = _comb((1, 300, 4, 4), torch.float32, seed=2)
    dy = torch.randn(1, 300, 4, 4, generator=torch.Generator().manual_seed(3))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = mhc_eager.sinkhorn(a, 20, 1e-6), mhc_math.sinkhorn(b, 20, 1e-6)
    # The output is a fresh tensor: changing it in place leaves the saved values (the backward) alone.
    saved = out.grad_fn.saved_tensors[0]
    assert not (saved.data_ptr() <= out.data_ptr() < saved.data_ptr() + saved.numel() * saved.element_size())
    (out * dy).sum().backward()
    (ref * dy).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_sinkhorn_rejects_zero_iterations():
    with pytest.raises(ValueError, match="iters >= 1"):
        mhc_eager.sinkhorn(_comb((2, 4, 4), torch.float32), 0, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_collapse_values_and_gradients_equal_the_reference(dtype):
    g = torch.Generator().manual_seed(4)
    pre = torch.rand(2, 9, 4, generator=g, dtype=dtype)
    streams = torch.randn(2, 9, 4, 16, generator=g, dtype=dtype)
    dy = torch.randn(2, 9, 16, generator=g, dtype=dtype)
    p1, s1, p2, s2 = (t.clone().requires_grad_() for t in (pre, streams, pre, streams))
    out, ref = mhc_eager.collapse(p1, s1), mhc_math.collapse(p2, s2)
    (out * dy).sum().backward()
    (ref * dy).sum().backward()
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(p1.grad, p2.grad, **tol)
    torch.testing.assert_close(s1.grad, s2.grad, **tol)


def test_collapse_in_bfloat16_is_the_reference():
    g = torch.Generator().manual_seed(5)
    pre, streams = torch.rand(1, 6, 4, generator=g), torch.randn(1, 6, 4, 32, generator=g).bfloat16()
    assert torch.equal(mhc_eager.collapse(pre, streams), mhc_math.collapse(pre, streams))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_expand_values_and_gradients_equal_the_reference(dtype):
    g = torch.Generator().manual_seed(6)
    post = torch.rand(2, 9, 4, generator=g, dtype=dtype) * 2
    comb = torch.rand(2, 9, 4, 4, generator=g, dtype=dtype)
    out = torch.randn(2, 9, 16, generator=g, dtype=dtype)
    residual = torch.randn(2, 9, 4, 16, generator=g, dtype=dtype)
    dy = torch.randn(2, 9, 4, 16, generator=g, dtype=dtype)
    a, b = [[t.clone().requires_grad_() for t in (post, comb, out, residual)] for _ in range(2)]
    got, want = mhc_eager.expand(*a), mhc_math.expand(*b)
    (got * dy).sum().backward()
    (want * dy).sum().backward()
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, want, **tol)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, **tol)


def test_expand_gradcheck_and_partial_gradients():
    g = torch.Generator().manual_seed(7)
    args = [torch.rand(1, 3, 4, generator=g, dtype=torch.float64), torch.rand(1, 3, 4, 4, generator=g, dtype=torch.float64),
            torch.randn(1, 3, 5, generator=g, dtype=torch.float64), torch.randn(1, 3, 4, 5, generator=g, dtype=torch.float64)]
    assert torch.autograd.gradcheck(mhc_eager.expand, [t.requires_grad_() for t in args])
    # Only the residual needs a gradient (a frozen sublayer): the others come back as None.
    frozen = [t.detach() for t in args[:3]] + [args[3].detach().requires_grad_()]
    mhc_eager.expand(*frozen).sum().backward()
    torch.testing.assert_close(frozen[3].grad, args[1].detach().sum(-1, keepdim=True).expand(1, 3, 4, 5))


def test_expand_in_bfloat16_is_the_reference():
    g = torch.Generator().manual_seed(8)
    post, comb = torch.rand(1, 5, 4, generator=g), torch.rand(1, 5, 4, 4, generator=g)
    out, residual = torch.randn(1, 5, 8, generator=g).bfloat16(), torch.randn(1, 5, 4, 8, generator=g).bfloat16()
    assert torch.equal(mhc_eager.expand(post, comb, out, residual), mhc_math.expand(post, comb, out, residual))
