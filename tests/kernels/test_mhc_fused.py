"""The fused mHC passes (genolong/kernels/mhc/fused.py) against the model's reference on the CPU: the
Triton code in Triton's interpreter (outputs and every gradient, fp32 and fp16 — the interpreter
has no bf16), the sm_90 builds (tensor cores, no spills, shared memory), and what it declines.
tests/gpu/test_mhc_fused.py repeats the comparison in bf16 on a GPU."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from genolong.model import ops

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# One mHC sublayer the way a layer runs it: mix + collapse, the sublayer (here: a product with a
# fixed tensor), expand; a loss that weights every output, so every gradient is checked. Prints one
# JSON line per case: the relative error of each output and gradient against the fp32 reference,
# and the same for the reference itself run in the case's dtype (what that dtype costs anyway).
_INTERPRETED = r"""
import json, sys
import torch
from genolong.kernels.mhc import fused as mf
from genolong.model import mhc

def sublayer(mix_collapse, expand, dtype, data, n):
    x, fn, base, scale, out, weights = data
    leaves = [x.to(dtype), fn.float(), base.float(), scale.float(), out.to(dtype)]
    leaves = [t.clone().requires_grad_() for t in leaves]
    xs, f, b, s, o = leaves
    post, comb, y = mix_collapse(xs, f, b, s)
    new = expand(post, comb, y * o, xs)
    loss = sum((t.double() * w).sum() for t, w in zip((post, comb, y, new), weights))
    loss.backward()
    return [post, comb, y, new] + [t.grad for t in leaves]

NAMES = ["post", "comb", "collapsed", "new streams", "d streams", "d fn", "d base", "d scale", "d out"]
for n, d, t, dtype in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(n * 1000 + d + t)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    k = (2 + n) * n
    data = (r(t, n, d), r(k, n * d) * (n * d) ** -0.5, r(k) * 0.3, torch.tensor([1.0, 0.7, 1.3], dtype=torch.float64),
            r(t, d), (r(t, n), r(t, n, n), r(t, d), r(t, n, d)))
    opts = dict(n=n, iters=20, eps=1e-6, rms_eps=1e-6)
    ref = lambda a, f, b, s: mhc.mix_collapse_reference(a, f, b, s, **opts)
    fused = lambda a, f, b, s: mf._MixCollapse.apply(a, f, b, s, n, 20, 1e-6, 1e-6)
    dt = getattr(torch, dtype)
    truth = sublayer(ref, mhc.expand_reference, torch.float32, data, n)
    got = sublayer(fused, mf._Expand.apply, dt, data, n)
    same_dtype = sublayer(ref, mhc.expand_reference, dt, data, n)
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
    print("CASE", json.dumps({"case": [n, d, t, dtype],
                              "fused": {name: rel(a, b) for name, a, b in zip(NAMES, got, truth)},
                              "reference": {name: rel(a, b) for name, a, b in zip(NAMES, same_dtype, truth)}}))
"""

# (streams n, hidden D, tokens T, dtype): masked tails in both the token and the hidden blocks;
# n = 2 and 8 change the logits' padding (8 -> 16, 80 -> 128 columns).
CASES = [(4, 80, 70, "float32"), (2, 130, 9, "float32"), (8, 40, 33, "float32"), (4, 256, 128, "float16"), (4, 72, 67, "float16")]


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED, json.dumps(CASES)], env=env, capture_output=True, text=True,
                         timeout=900)
    found = {tuple(rec["case"]): rec for rec in (json.loads(line[5:]) for line in run.stdout.splitlines() if line.startswith("CASE "))}
    assert len(found) == len(CASES), run.stdout[-2000:] + run.stderr[-3000:]
    return found


@needs_triton
@pytest.mark.parametrize("case", [c for c in CASES if c[3] == "float32"], ids=str)
def test_fp32_passes_equal_the_reference_to_rounding(interpreted, case):
    errors = interpreted[case]["fused"]
    assert max(errors.values()) < 2e-6, errors


@needs_triton
@pytest.mark.parametrize("case", [c for c in CASES if c[3] == "float16"], ids=str)
def test_16_bit_passes_are_no_worse_than_the_reference_in_the_same_dtype(interpreted, case):
    # The fused passes accumulate in fp32 and round once; the reference rounds after each op. Each
    # output and gradient must be within 1.5x the reference's own 16-bit error (plus a floor for
    # errors at fp32 rounding), so a wrong term, index or mask shows as a 100x-1000x failure.
    rec = interpreted[case]
    for name, err in rec["fused"].items():
        assert err <= 1.5 * rec["reference"][name] + 1e-5, (name, err, rec["reference"][name])


_UNDER_RECOMPUTE = r"""
import torch
from torch.utils.checkpoint import checkpoint
from genolong.kernels.mhc import fused as mf
g = torch.Generator().manual_seed(5)
x = torch.randn(40, 4, 48, generator=g)
fn, base, scale = torch.randn(24, 192, generator=g) * 0.07, torch.randn(24, generator=g) * 0.3, torch.ones(3)
out, w = torch.randn(40, 48, generator=g), torch.randn(40, 4, 48, generator=g)

def sublayer(x, fn, base, scale):
    post, comb, y = mf._MixCollapse.apply(x, fn, base, scale, 4, 20, 1e-6, 1e-6)
    return mf._Expand.apply(post, comb, torch.tanh(y) * out, x)

grads = []
for recompute in (False, True):
    leaves = [t.clone().requires_grad_() for t in (x, fn, base, scale)]
    new = checkpoint(sublayer, *leaves, use_reentrant=False) if recompute else sublayer(*leaves)
    (new * w).sum().backward()
    grads.append([l.grad for l in leaves])
print("MAXDIFF", max((a - b).abs().max().item() for a, b in zip(*grads)))
"""


@needs_triton
def test_the_autograd_functions_recompute_under_a_non_reentrant_checkpoint():
    # The training passes wrap every layer in such a checkpoint; the mix's backward recomputes its
    # pointwise tail with autograd inside the backward, which must not disturb the checkpoint.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _UNDER_RECOMPUTE], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("MAXDIFF")]
    assert lines, run.stdout[-2000:] + run.stderr[-3000:]
    assert float(lines[0].split()[1]) == 0.0, lines[0]


@needs_triton
@pytest.mark.parametrize("n,hidden,dtype", [(4, 1024, "bf16"), (4, 4096, "bf16"), (4, 1024, "fp32"), (2, 1024, "bf16"),
                                          (8, 4096, "bf16"), (8, 1024, "fp32")])  # every stream count the ops take
def test_passes_build_for_sm90_with_tensor_cores_and_no_spills(n, hidden, dtype):
    from genolong.kernels import aot
    from genolong.kernels.mhc import fused as mhc_fused

    built = mhc_fused.aot_compile(n=n, hidden=hidden, dtype=dtype)
    assert set(built) == {"mix_logits", "collapse", "collapse_dpre", "mix_collapse_dx", "expand", "expand_bwd"}
    for name, kernel in built.items():
        registers, spills = aot.ptxas_usage(kernel)
        # (8 fp32 streams: the backward passes spill, ~10 KB at most, slower but right; the shared
        # memory is what would stop a launch)
        assert spills == 0 or (n, dtype) == (8, "fp32"), f"{name} spills {spills} bytes ({registers} registers)"
        assert kernel.metadata.shared <= aot.SM90_SHARED_BYTES, (name, kernel.metadata.shared)
    if dtype == "bf16":  # the two passes with the logits' product run it on Hopper's tensor cores
        for name in ("mix_logits", "mix_collapse_dx"):
            assert "wgmma" in built[name].asm["ptx"], name


@needs_triton
def test_the_ops_decline_what_they_cannot_run():
    from genolong.kernels.mhc import fused as mhc_fused

    streams, fn, base, scale = torch.randn(1, 3, 4, 8), torch.randn(24, 32), torch.zeros(24), torch.ones(3)
    with pytest.raises(ops.KernelUnsupported, match="CUDA"):
        mhc_fused.mhc_mix_collapse_fused(streams, fn, base, scale, n=4, iters=20, eps=1e-6, rms_eps=1e-6)
    with pytest.raises(ops.KernelUnsupported, match="CUDA"):
        mhc_fused.mhc_expand_fused(torch.rand(1, 3, 4), torch.rand(1, 3, 4, 4), torch.randn(1, 3, 8), streams)
    assert "power-of-two stream count" in mhc_fused._decline(torch.randn(1, 3, 3, 8), 3)
    assert "bf16, fp16 or fp32" in mhc_fused._decline(torch.zeros(1, 3, 4, 8, dtype=torch.float64), 4)


def test_the_reference_ops_are_the_modules_eager_path():
    """HyperConnection runs through the ops; under the reference policy that is the eager code."""
    from genolong.model import mhc, mhc_eager, mhc_math
    from genolong.model.config import MHCConfig

    torch.manual_seed(0)
    hc = mhc.HyperConnection(16, MHCConfig(), rms_eps=1e-6, layer_idx=3)
    torch.nn.init.normal_(hc.fn, std=0.1)
    streams = torch.randn(2, 5, hc.n, 16)
    with ops.policy("reference") as policy:
        post, comb, x = hc(streams)
        new = hc.expand(post, comb, x, streams)
    pre_w, post_w, comb_w = mhc_math.mix_weights(streams, hc.fn, hc.base, hc.scale, n=hc.n, eps=hc.eps, rms_eps=hc.rms_eps)
    assert torch.allclose(post, post_w) and torch.allclose(x, mhc_math.collapse(pre_w, streams), atol=1e-6)
    assert torch.allclose(comb, mhc_math.sinkhorn(comb_w, hc.sinkhorn_iters, hc.eps), atol=1e-6)
    assert torch.allclose(new, mhc_eager.expand(post, comb, x, streams))
    assert policy.audit == {(3, "mhc_mix_collapse"): ops.REFERENCE, (3, "mhc_expand"): ops.REFERENCE}
