"""The router's top-k kernel (genolong/kernels/moe/router_topk.py): in Triton's interpreter against
torch.topk, the custom op's CPU fallback and its tracing by torch.compile inside the router's
math, the setting, the sm_90 build."""

import importlib.util

import pytest
import torch

from genolong.errors import GenolongError
from tests.kernels.interpreted import run_script

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_INTERPRETED = r"""
import torch
from genolong.kernels.moe.router_topk import router_topk_triton
g = torch.Generator().manual_seed(0)
bad = []
# (tokens, experts, k): glm53-mini's 64 / 4 over several programs and a partial last one; 288 / 8
# (not a power of two); k = experts; a few experts.
for n, e, k in ((300, 64, 4), (37, 288, 8), (64, 16, 16), (9, 10, 3)):
    s = torch.rand(n, e, generator=g)
    s[0] = 0.5                                           # every expert tied: the lowest indices
    s[1, : e // 2] = float("-inf")                       # half masked (the grouped routing's -inf)
    s[2, 3] = float("nan")                               # NaN ranks first
    s[3] = float("-inf")                                 # all masked: k distinct experts still
    s[4, 5:9] = 2.0                                      # ties among the best
    s[5] = torch.randint(0, 3, (e,), generator=g).float()
    want = torch.where(s.isnan(), float("inf"), s)
    order = torch.sort(want, dim=-1, descending=True, stable=True)  # ties: the lower index first
    for layout in ("contiguous", "strided"):
        x = s if layout == "contiguous" else torch.cat([s, s], 1)[:, :e]
        idx = router_topk_triton(x, k)
        if not (idx.dtype == torch.int64 and torch.equal(idx, order.indices[:, :k])):
            bad.append((n, e, k, layout))
print("MISMATCHED", bad)
"""


@needs_triton
def test_kernel_in_the_interpreter_picks_what_a_stable_sort_picks():
    run = run_script(_INTERPRETED)
    assert "MISMATCHED []" in run.stdout, run.stdout + run.stderr[-3000:]


@needs_triton
def test_custom_op_falls_back_to_torch_topk_off_cuda_and_traces_in_the_router():
    from genolong.kernels.moe import router_topk  # noqa: F401  (registers the op)
    from genolong.model.config import MoEConfig
    from genolong.model.moe import route

    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=16, top_k=4, expert_dim=8)
    x, w, bias = torch.randn(50, 32), torch.randn(16, 32) * 0.1, torch.randn(16) * 0.01
    idx = torch.ops.genolong.router_topk(x @ w.T, 4)
    assert torch.equal(idx.sort(-1).values, (x @ w.T).topk(4, dim=-1).indices.sort(-1).values)
    want_idx, want_w = route(x, w, bias, cfg)
    # The compiled router's graph with the op in it (aot_eager: dynamo + the op's fake, no codegen),
    # the token dimension dynamic as apply_compile marks it: a second length reuses the graph.
    traced = torch.compile(lambda *a: route(*a, top_indices=torch.ops.genolong.router_topk), backend="aot_eager", dynamic=True)
    got_idx, got_w = traced(x, w, bias, cfg)
    order, want_order = got_idx.argsort(-1), want_idx.argsort(-1)
    assert torch.equal(got_idx.gather(1, order), want_idx.gather(1, want_order))
    assert torch.allclose(got_w.gather(1, order), want_w.gather(1, want_order))
    assert traced(x[:31], w, bias, cfg)[0].shape == (31, 4)


@needs_triton
def test_setting_is_read_from_the_environment(monkeypatch):
    from genolong.kernels.moe import router_topk

    monkeypatch.delenv(router_topk.ENV, raising=False)
    assert router_topk.setting() == "triton"
    monkeypatch.setenv(router_topk.ENV, "torch")
    assert router_topk.setting() == "torch"
    monkeypatch.setenv(router_topk.ENV, "fused")
    with pytest.raises(GenolongError, match="GENOLONG_ROUTER_TOPK='fused' is not a setting; set it to one of triton, torch"):
        router_topk.setting()


@needs_triton
def test_kernel_refuses_what_it_does_not_take(monkeypatch):
    from genolong.kernels.moe.router_topk import unsupported

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert unsupported(torch.zeros(4, 64), 4) == "not a CUDA tensor"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs CPU tensors: the shapes decide
    assert unsupported(torch.zeros(4, 64), 4) is None
    assert "fp32" in unsupported(torch.zeros(4, 64, dtype=torch.bfloat16), 4)
    assert "fp32" in unsupported(torch.zeros(2, 4, 64), 4)
    assert "top 17 of 64" in unsupported(torch.zeros(4, 64), 17)
    assert "top 5 of 4" in unsupported(torch.zeros(4, 4), 5)
    assert "top 8 of 2048" in unsupported(torch.zeros(4, 2048), 8)


@needs_triton
@pytest.mark.parametrize("experts,k", [(64, 4), (288, 8)])  # glm53-mini; a GLM-5.3-Flash-sized router
def test_kernel_builds_for_sm90_without_spills(experts, k):
    from genolong.kernels import aot
    from genolong.kernels.moe import router_topk

    kernel = router_topk.aot_compile(experts, k)
    assert aot.ptxas_usage(kernel)[1] == 0
    assert "st.global" in kernel.asm["ptx"]
