"""The fused clamped SwiGLU of the MoE experts (genolong/kernels/moe/swiglu.py) in Triton's CPU
interpreter against autograd of the model's eager expression (genolong.model.mlp.clamped_swiglu):
values and gradients, the clamp bounds themselves, NaN, masked tails; inside the grouped MoE path
with every gradient; the sm_90 builds; the setting that picks it."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# 45 rows x inter 40: each program's 32 rows x 128 columns have masked tails in both directions.
_INTERPRETED = r"""
import json
import torch
from genolong.kernels.moe import grouped as mg
from genolong.kernels.moe import swiglu as st

g = torch.Generator().manual_seed(0)
limit = 1.5
results = {}

def rel(a, b):
    a, b = a.double(), b.double()
    return float("inf") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm().clamp(min=1e-30)).item()

def both(gu, dh):
    out = []
    for fn in (mg.swiglu_eager, st.clamped_swiglu_packed):
        leaf = gu.clone().requires_grad_()
        h = fn(leaf, limit)
        h.backward(dh)
        out.append((h.detach(), leaf.grad))
    return out

gu = torch.randn(45, 80, generator=g, dtype=torch.float64).float() * 2.0  # many values beyond +-1.5
gu[0, :4] = torch.tensor([limit, -limit, limit + 1e-3, -limit - 1e-3])  # gate at the bounds
gu[1, 40:44] = torch.tensor([limit, -limit, limit + 1e-3, -limit - 1e-3])  # up at the bounds
dh = torch.randn(45, 40, generator=g)
(eh, eg), (th, tg) = both(gu, dh)
results["fp32"] = dict(h=rel(th, eh), grad=rel(tg, eg), bounds_grad=(tg[:2] - eg[:2]).abs().max().item(),
                       beyond=int(((gu[:, :40] > limit).sum() + (gu[:, 40:].abs() > limit).sum()).item()))

# fp16 inputs (the interpreter has no bf16): against the eager expression in fp32 on the same values.
gu16 = gu.half()
(eh, eg), _ = both(gu16.float(), dh.float())
_, (th, tg) = both(gu16, dh.half())
results["fp16"] = dict(h=rel(th, eh), grad=rel(tg, eg), dtype=str(th.dtype))

nan = gu[:2].clone()
nan[0, 3] = float("nan")
nan[1, 40 + 5] = float("nan")
(eh, _), (th, _) = both(nan, dh[:2])
results["nan"] = dict(same_nan=bool(torch.equal(th.isnan(), eh.isnan())), any_nan=bool(th.isnan().any()))

empty = both(torch.zeros(0, 80), torch.zeros(0, 40))[1]
results["empty"] = dict(shape=list(empty[0].shape), grad_shape=list(empty[1].shape))

# Inside the grouped MoE path: 37 tokens x top-3 of 8 experts, chunks of 20 tokens.
n, experts, k, hidden, inter = 37, 8, 3, 40, 24
x = torch.randn(n, hidden, generator=g)
idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
w = torch.rand(n, k, generator=g)
gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5 * 4  # activations beyond the limit
down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
dy = torch.randn(n, hidden, generator=g)

def run(swiglu):
    leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    y = mg.experts_grouped(leaves[0], idx, leaves[1], leaves[2], leaves[3], swiglu_limit=limit, chunk_tokens=20,
                           mm=mg.grouped_mm_loop, swiglu=swiglu)
    (y * dy).sum().backward()
    return [y] + [t.grad for t in leaves]

names = ["y", "d x", "d router weights", "d gate_up", "d down"]
results["moe"] = {name: rel(a, b) for name, a, b in zip(names, run(st.clamped_swiglu_packed), run(mg.swiglu_eager))}
print("RESULT " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    lines = [line[7:] for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(lines[0])


@needs_triton
def test_fused_swiglu_matches_the_eager_expression_and_its_gradient(interpreted):
    r = interpreted["fp32"]
    assert r["beyond"] > 500  # the clamps are exercised, not only the silu
    assert r["h"] < 1e-6 and r["grad"] < 1e-6, r
    assert r["bounds_grad"] < 1e-6, r  # the gradient passes at the bounds and stops just beyond, as torch.clamp's
    r = interpreted["fp16"]
    assert r["dtype"] == "torch.float16" and r["h"] < 2e-3 and r["grad"] < 2e-3, r  # one rounding of each output


@needs_triton
def test_fused_swiglu_propagates_nan_and_takes_empty_chunks(interpreted):
    assert interpreted["nan"] == {"same_nan": True, "any_nan": True}
    assert interpreted["empty"] == {"shape": [0, 40], "grad_shape": [0, 80]}


@needs_triton
def test_grouped_moe_with_the_fused_swiglu_has_the_eager_gradients(interpreted):
    errors = interpreted["moe"]
    assert len(errors) == 5
    for name, err in errors.items():
        assert err < 1e-6, (name, err)  # fp32 both ways


@needs_triton
def test_swiglu_kernels_compile_for_sm90_without_spills():
    from genolong.kernels import aot
    from genolong.kernels.moe import swiglu as swiglu_triton

    for inter in (256, 2048):  # glm53-mini, GLM-5.3-Flash
        for name, kernel in swiglu_triton.aot_compile(inter).items():
            registers, spills = aot.ptxas_usage(kernel)
            assert spills == 0 and registers <= 255, (inter, name, registers, spills)


def test_swiglu_setting_names_a_wrong_value(monkeypatch):
    from genolong.errors import GenolongError
    from genolong.kernels.moe.swiglu import swiglu_mode

    monkeypatch.setenv("GENOLONG_MOE_SWIGLU", "fused")
    with pytest.raises(GenolongError, match="GENOLONG_MOE_SWIGLU='fused' is not a setting; set it to one of triton, eager, or unset it"):
        swiglu_mode()
    monkeypatch.delenv("GENOLONG_MOE_SWIGLU")
    assert swiglu_mode() == "triton"  # the default since the H200 measurement


def test_packed_swiglu_refuses_an_odd_width():
    pytest.importorskip("triton")
    import torch

    from genolong.kernels.moe.swiglu import clamped_swiglu_packed

    with pytest.raises(ValueError, match=r"gate_up must be \[rows, 2 \* inter\], got \(4, 5\)"):
        clamped_swiglu_packed(torch.zeros(4, 5), 1.0)
