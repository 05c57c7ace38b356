"""The "kda" reference op against the step-by-step recurrence of docs/ops.md.

`kda_reference` is the oracle of the GPU kernel (fla's chunk_kda) and the CPU path of the model,
so it is checked here against the plainest restatement of the recurrence, one token at a time
in float64: outputs, gradients, the state in and out, and the properties its chunked form must
keep (chunk-size independence, no overflow whatever the gates).
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from genolong.errors import GenolongError
from genolong.model.kda import kda_reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def kda_step_by_step(q, k, v, g, beta, initial_state=None):
    """docs/ops.md's recurrence, one token at a time, in float64: (o [B,T,H,Dv], final state [B,H,Dk,Dv])."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    batch, seq, heads, dk = k.shape
    if initial_state is None:
        state = torch.zeros(batch, heads, dk, v.shape[-1], dtype=torch.float64)
    else:
        state = initial_state.double()
    out = []
    for t in range(seq):
        state = state * g[:, t].exp().unsqueeze(-1)
        correction = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t].unsqueeze(-1) * correction.unsqueeze(-2)
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1), state


def _kda_inputs(seq, gate_scale=5.0, seed=0, heads=2, dk=8, dv=12, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq, heads, dk, generator=gen)
    k = torch.randn(2, seq, heads, dk, generator=gen)
    v = torch.randn(2, seq, heads, dv, generator=gen)
    g = -gate_scale * torch.rand(2, seq, heads, dk, generator=gen)
    beta = torch.rand(2, seq, heads, generator=gen)
    state = torch.randn(2, heads, dk, dv, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, beta)], state.to(dtype)


@pytest.mark.parametrize("seq,chunk", [(1, 16), (37, 8), (64, 16), (100, 32), (100, 64), (21, 1)])
def test_kda_reference_matches_recurrence(seq, chunk):
    inputs, _ = _kda_inputs(seq)
    out = kda_reference(*inputs, chunk_size=chunk)
    expected, _ = kda_step_by_step(*inputs)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert (out.double() - expected).abs().max() < 2e-5


def test_kda_reference_state_in_and_out_match_recurrence():
    inputs, state = _kda_inputs(45)
    out, final = kda_reference(*inputs, initial_state=state, output_final_state=True, chunk_size=16)
    expected, expected_final = kda_step_by_step(*inputs, initial_state=state)
    assert final.shape == state.shape and final.dtype == torch.float32
    assert (out.double() - expected).abs().max() < 2e-5
    assert (final.double() - expected_final).abs().max() < 2e-5


def test_kda_reference_gradients_match_recurrence():
    inputs, state = _kda_inputs(40, dtype=torch.float64)
    leaves = [x.requires_grad_() for x in [*inputs, state]]
    out, final = kda_reference(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=16)
    grads = torch.autograd.grad(out.square().sum() + final.sin().sum(), leaves)
    out, final = kda_step_by_step(*leaves[:5], initial_state=leaves[5])
    expected = torch.autograd.grad(out.square().sum() + final.sin().sum(), leaves)
    for name, got, want in zip(["q", "k", "v", "g", "beta", "initial_state"], grads, expected):
        assert _rel(got, want) < 1e-8, name


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-11)])
def test_kda_reference_is_independent_of_the_chunk_size(dtype, tol):
    inputs, state = _kda_inputs(150, dtype=dtype)
    runs = []
    for chunk in (2, 16, 64):
        leaves = [x.detach().clone().requires_grad_() for x in [*inputs, state]]
        out, final = kda_reference(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=chunk)
        grads = torch.autograd.grad(out.square().sum() + final.square().sum(), leaves)
        runs.append([out, final, *grads])
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"]
    for other in runs[1:]:
        for name, got, want in zip(names, other, runs[0]):
            assert got.dtype == dtype
            assert _rel(got, want) < tol, name


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-11)])
def test_kda_reference_in_two_pieces_equals_whole(dtype, tol):
    """The state passed from the first piece to the second reproduces the whole sequence's
    outputs and gradients, including those of the initial state (what context parallelism needs)."""
    inputs, state = _kda_inputs(100, dtype=dtype)
    cut = 37  # not a chunk boundary

    def whole(*leaves):
        return kda_reference(*leaves[:5], initial_state=leaves[5], output_final_state=True)

    def pieces(*leaves):
        head = [x[:, :cut] for x in leaves[:5]]
        tail = [x[:, cut:] for x in leaves[:5]]
        o1, mid = kda_reference(*head, initial_state=leaves[5], output_final_state=True)
        o2, final = kda_reference(*tail, initial_state=mid, output_final_state=True)
        return torch.cat([o1, o2], dim=1), final

    results = []
    for fn in (whole, pieces):
        leaves = [x.detach().clone().requires_grad_() for x in [*inputs, state]]
        out, final = fn(*leaves)
        grads = torch.autograd.grad(out.square().sum() + final.square().sum(), leaves)
        results.append([out, final, *grads])
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"]
    for name, got, want in zip(names, results[1], results[0]):
        assert _rel(got, want) < tol, name


def test_kda_reference_survives_strong_decay():
    # 64 steps of log-decay -40 would overflow any exp(+G) factorisation; the reference never forms one.
    inputs, _ = _kda_inputs(64, gate_scale=40.0)
    out = kda_reference(*inputs, chunk_size=32)
    assert torch.isfinite(out).all()
    assert (out.double() - kda_step_by_step(*inputs)[0]).abs().max() < 2e-5


class _ExpArguments(TorchFunctionMode):
    """Records the largest argument every exp sees."""

    def __init__(self):
        super().__init__()
        self.largest = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.exp, torch.Tensor.exp, torch.exp_, torch.Tensor.exp_):
            finite = args[0][torch.isfinite(args[0])]
            self.largest.append(finite.max().item() if finite.numel() else float("-inf"))
        return func(*args, **(kwargs or {}))


def test_kda_reference_exponentiates_only_non_positive_numbers():
    inputs, state = _kda_inputs(100, gate_scale=40.0)
    with _ExpArguments() as seen:
        kda_reference(*inputs, initial_state=state, output_final_state=True, chunk_size=32)
    assert seen.largest, "no exp recorded: the guard does not see the reference's calls"
    assert max(seen.largest) <= 0.0


def test_kda_reference_keeps_bf16_io():
    (q, k, v, g, beta), _ = _kda_inputs(40)
    out = kda_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16())
    assert out.dtype == torch.bfloat16
    assert (out.double() - kda_step_by_step(q, k, v, g, beta)[0]).abs().max() < 0.05


def test_kda_reference_rejects_a_state_of_the_wrong_shape():
    inputs, state = _kda_inputs(10)
    with pytest.raises(GenolongError, match=r"initial_state has shape \[2, 2, 12, 8\], expected \[B, H, Dk, Dv\] = \[2, 2, 8, 12\]"):
        kda_reference(*inputs, initial_state=state.transpose(-1, -2))


def test_kda_reference_needs_a_power_of_two_chunk():
    inputs, _ = _kda_inputs(10)
    with pytest.raises(ValueError, match="power of two, got 12"):
        kda_reference(*inputs, chunk_size=12)
