"""The fused clamped SwiGLU on a CUDA GPU in bf16 against the eager expression (skipped without a
GPU), and glm53-mini's MoE block with it against the eager activation."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_fused_swiglu_in_bf16_matches_the_eager_expression():
    from genolong.kernels.moe import grouped as mg
    from genolong.kernels.moe import swiglu as st

    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(20000, 512, generator=g, device="cuda") * 6).to(torch.bfloat16)  # many beyond the limit 10
    dh = torch.randn(20000, 256, generator=g, device="cuda", dtype=torch.bfloat16)
    got = []
    for fn in (mg.swiglu_eager, st.clamped_swiglu_packed):
        leaf = gate_up.clone().requires_grad_()
        h = fn(leaf, 10.0)
        h.backward(dh)
        got.append((h.float(), leaf.grad.float()))
    for a, b in zip(*got):
        # four bf16 roundings (eager) against one: ~bf16 epsilon apart.
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_moe_block_with_the_fused_swiglu_matches_eager(monkeypatch):
    from tests.gpu.test_moe_combine import moe_block_arms

    # Inputs scaled so that many activations pass the clamp limit (10).
    for a, b in zip(*moe_block_arms(monkeypatch, "GENOLONG_MOE_SWIGLU", ("eager", "triton"), x_scale=8.0)):
        assert ((a - b).norm() / b.norm().clamp_min(1e-12)).item() < 2e-2
