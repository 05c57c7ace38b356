"""The atomics-free MoE combine and the dispatch's read-side backward (genolong/kernels/moe/combine.py)
in Triton's CPU interpreter against the index_add combine and the indexing dispatch they replace: the
grouped MoE path's output and the gradients of x, both expert weights and the router weights; the
dispatch alone, values and gradient; the sm_90 builds; the settings that pick them."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# 37 tokens x top-3 of 8 experts (skewed: the last two get none), hidden 40: every block has a
# masked tail (16 tokens, 128 columns, 32 rows per program); chunks of 20 tokens (two chunks).
_INTERPRETED = r"""
import json
import torch
from genolong.kernels.moe import combine as mc
from genolong.kernels.moe import grouped as mg

g = torch.Generator().manual_seed(0)
n, experts, k, hidden, inter = 37, 8, 3, 40, 24
x = torch.randn(n, hidden, generator=g)
probs = torch.tensor([8.0] + [1.0] * (experts - 3) + [0.0, 0.0])
idx = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(n)])
w = torch.rand(n, k, generator=g)
gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
dy = torch.randn(n, hidden, generator=g)

def run(combine, dispatch):
    leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    y = mg.experts_grouped(leaves[0], idx, leaves[1], leaves[2], leaves[3], swiglu_limit=1.5, chunk_tokens=20,
                           mm=mg.grouped_mm_loop, combine=combine, dispatch=dispatch)
    (y * dy).sum().backward()
    return [y] + [t.grad for t in leaves]

names = ["y", "d x", "d router weights", "d gate_up", "d down"]
ref = run(mg.combine_index_add, mc.dispatch_index)
for label, combine, dispatch in (("combine", mc.combine, mc.dispatch_index), ("dispatch", mg.combine_index_add, mc.dispatch),
                                 ("both", mc.combine, mc.dispatch)):
    got = run(combine, dispatch)
    print(label, json.dumps({name: ((a - b).norm() / b.norm()).item() for name, a, b in zip(names, got, ref)}))

# The dispatch alone: the same rows as indexing; its gradient, each token's k row gradients summed,
# against autograd's index backward (a token routed to fewer slots than k cannot happen: top-k).
order = torch.sort(idx.reshape(-1), stable=True).indices
xs = [x.clone().requires_grad_() for _ in range(2)]
rows = [mc.dispatch(xs[0], order, k), mc.dispatch_index(xs[1], order, k)]
drows = torch.randn(rows[0].shape, generator=g)
for r in rows:
    (r * drows).sum().backward()
print("alone", json.dumps({"same rows": bool(torch.equal(rows[0], rows[1])),
                           "d x": ((xs[0].grad - xs[1].grad).norm() / xs[1].grad.norm()).item()}))
"""


@needs_triton
def test_triton_combine_in_the_interpreter_matches_index_add_with_every_gradient():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = dict(line.split(" ", 1) for line in run.stdout.strip().splitlines()[-4:])
    assert sorted(results) == ["alone", "both", "combine", "dispatch"], run.stdout[-2000:]
    for label in ("combine", "dispatch", "both"):
        errors = json.loads(results[label])
        assert len(errors) == 5
        for name, err in errors.items():
            assert err < 1e-6, (label, name, err)  # fp32 both ways: only the order of the k adds differs
    alone = json.loads(results["alone"])
    assert alone["same rows"] and alone["d x"] < 1e-6, alone


@needs_triton
def test_combine_kernels_compile_for_sm90_without_spills():
    from genolong.kernels import aot
    from genolong.kernels.moe import combine as moe_combine_triton

    for hidden, k in ((512, 4), (4096, 8)):  # glm53-mini, GLM-5.3-Flash
        for name, kernel in moe_combine_triton.aot_compile(hidden, k).items():
            registers, spills = aot.ptxas_usage(kernel)
            assert spills == 0 and registers <= 255, (hidden, name, registers, spills)


def test_combine_setting_names_a_wrong_value(monkeypatch):
    from genolong.errors import GenolongError
    from genolong.kernels.moe.combine import combine_mode

    monkeypatch.setenv("GENOLONG_MOE_COMBINE", "atomic")
    with pytest.raises(GenolongError, match="GENOLONG_MOE_COMBINE='atomic' is not a setting; set it to one of triton, index_add"):
        combine_mode()
    monkeypatch.delenv("GENOLONG_MOE_COMBINE")
    assert combine_mode() == "triton"


def test_dispatch_setting_names_a_wrong_value(monkeypatch):
    from genolong.errors import GenolongError
    from genolong.kernels.moe.combine import ENV_DISPATCH, dispatch_mode

    monkeypatch.delenv(ENV_DISPATCH, raising=False)
    assert dispatch_mode() == "triton"
    monkeypatch.setenv(ENV_DISPATCH, "index")
    assert dispatch_mode() == "index"
    monkeypatch.setenv(ENV_DISPATCH, "scatter")
    with pytest.raises(GenolongError, match="GENOLONG_MOE_DISPATCH='scatter' is not a setting; set it to one of triton, index"):
        dispatch_mode()
