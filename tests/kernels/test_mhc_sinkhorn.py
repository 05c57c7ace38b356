"""mHC's Sinkhorn kernels (genolong/kernels/mhc/sinkhorn.py) against the model's reference: the Triton
code in Triton's CPU interpreter (outputs and gradients), the custom op's autograd, the sm_90 build."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from genolong.model.mhc_math import sinkhorn

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_INTERPRETED = """
import torch
from genolong.kernels.mhc import sinkhorn as ms
from genolong.model.mhc_math import sinkhorn
g = torch.Generator().manual_seed(0)
# 150 tokens: a full block of 128 and a masked tail; iters 20 (the model's) and 1 (no row pass).
for iters in (20, 1):
    x = torch.softmax(torch.randn(150, 4, 4, generator=g, dtype=torch.float64) * 2, -1) + 1e-6
    dy = torch.randn(150, 4, 4, generator=g, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    ref = sinkhorn(xr, iters, 1e-6)
    ref.backward(dy)
    y = ms.sinkhorn_forward(x.float(), iters, 1e-6)
    dx = ms.sinkhorn_backward(x.float(), dy.float(), iters, 1e-6)
    print("ITERS", iters, "FWD", (y.double() - ref).abs().max().item(),
          "BWD", ((dx.double() - xr.grad).norm() / xr.grad.norm()).item())
"""


@needs_triton
def test_triton_sinkhorn_in_the_interpreter_matches_the_reference():
    # The forward and the O(steps) backward against autograd in float64.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    lines = [line.split() for line in run.stdout.splitlines() if line.startswith("ITERS")]
    assert len(lines) == 2, run.stdout + run.stderr[-3000:]  # two iteration counts
    for line in lines:
        fwd, bwd = float(line[3]), float(line[5])
        assert fwd < 1e-5 and bwd < 1e-5, line


def test_custom_op_gradient_equals_the_reference():
    from genolong.kernels.mhc import sinkhorn as mhc_sinkhorn  # noqa: F401  (registers the op)

    g = torch.Generator().manual_seed(1)
    x = torch.softmax(torch.randn(2, 5, 4, 4, generator=g), -1) + 1e-6
    dy = torch.randn(2, 5, 4, 4, generator=g)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = torch.ops.genolong.mhc_sinkhorn(a, 20, 1e-6)
    ref = sinkhorn(b, 20, 1e-6)
    (out * dy).sum().backward()
    (ref * dy).sum().backward()
    assert torch.allclose(out, ref) and torch.allclose(a.grad, b.grad, atol=1e-6)
    # The columns of the result sum to one (the last pass), the rows nearly so.
    assert torch.allclose(out.sum(-2), torch.ones(2, 5, 4), atol=1e-5)


def test_supported_names_what_it_declines():
    from genolong.kernels.mhc.sinkhorn import supported

    assert "fp32" in supported(torch.ones(3, 4, 4, dtype=torch.bfloat16))
    assert "square" in supported(torch.ones(3, 4, 3))


@needs_triton
def test_sinkhorn_kernels_compile_for_sm90_without_spills():
    from genolong.kernels.mhc import sinkhorn as mhc_sinkhorn

    from genolong.kernels import aot

    for name, kernel in mhc_sinkhorn.aot_compile().items():
        assert ".local" not in kernel.asm["ptx"], name
        assert kernel.metadata.shared <= aot.SM90_SHARED_BYTES, (name, kernel.metadata.shared)
