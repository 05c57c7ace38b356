"""fla's KDA kernel with the recurrent state in and out, against the reference (needs CUDA).

The reference runs in fp32 from the same bf16 inputs and the same fp32 initial state; outputs,
the final state and all gradients (including the initial state's) are compared by relative
Frobenius error, as tests/gpu/test_kernels.py does for the state-less call.
"""

import pytest
import torch

import genolong.kernels as kernels
from genolong.model import ops

pytestmark = pytest.mark.gpu
DEV = "cuda"
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


@pytest.fixture(autouse=True)
def _setup():
    kernels.load()
    torch.manual_seed(0)


def _rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def _inputs(b=2, t=1000, h=4, d=128):
    q, k, v = (torch.randn(b, t, h, d, device=DEV).bfloat16() for _ in range(3))
    g = (-5 * torch.sigmoid(torch.randn(b, t, h, d, device=DEV))).float()
    beta = torch.rand(b, t, h, device=DEV).bfloat16()
    state = torch.randn(b, h, d, d, device=DEV) * 0.5
    return (q, k, v, g, beta), state


def _run(fn, inputs, state, dtype, seed=1):
    # g stays fp32, as the model passes it (ForgetGate computes in fp32).
    leaves = [x.detach().to(torch.float32 if i == 3 else dtype).requires_grad_() for i, x in enumerate(inputs)]
    h0 = state.detach().clone().requires_grad_()
    out, final = fn(*leaves, initial_state=h0, output_final_state=True)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    dout = torch.randn(out.shape, device=DEV, generator=gen)
    dfinal = torch.randn(final.shape, device=DEV, generator=gen)
    torch.autograd.backward([out, final], [dout.to(out.dtype), dfinal.to(final.dtype)])
    return [out, final] + [x.grad for x in leaves] + [h0.grad]


def test_kda_fla_with_state_matches_reference():
    inputs, state = _inputs()
    ref = _run(ops.implementations("kda")["reference"], inputs, state, torch.float32)
    got = _run(ops.implementations("kda")["fla_chunk_kda"], inputs, state, torch.bfloat16)
    assert got[1].dtype == torch.float32 and got[1].shape == state.shape
    for name, x, r in zip(NAMES, got, ref):
        assert _rel(x, r) <= 2e-2, (name, _rel(x, r))


def test_kda_fla_two_pieces_equal_whole():
    fla = ops.implementations("kda")["fla_chunk_kda"]
    inputs, state = _inputs(t=1500)
    cut = 700  # not a multiple of fla's 64-token chunk

    def pieces(*leaves, initial_state, output_final_state):
        o1, mid = fla(*(x[:, :cut] for x in leaves), initial_state=initial_state, output_final_state=True)
        o2, final = fla(*(x[:, cut:] for x in leaves), initial_state=mid, output_final_state=True)
        return torch.cat([o1, o2], dim=1), final

    whole = _run(fla, inputs, state, torch.bfloat16)
    split = _run(pieces, inputs, state, torch.bfloat16)
    for name, x, r in zip(NAMES, split, whole):
        assert _rel(x, r) <= 1e-2, (name, _rel(x, r))
