"""The atomics-free MoE combine on a CUDA GPU in bf16 against the index_add combine (skipped without
a GPU), and glm53-mini's MoE block with the Triton combine (the default) against index_add."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_triton_combine_in_bf16_matches_index_add():
    from genolong.kernels.moe import combine as mc

    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, k, hidden = 5000, 4, 512
    order = torch.argsort(torch.randint(0, 64, (tokens * k,), generator=g, device="cuda"), stable=True)
    out = torch.randn(tokens * k, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(tokens * k, generator=g, device="cuda")
    dy = torch.randn(tokens, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    grads = []
    for combine in (mc.combine_index_add, mc.combine):
        o, w = out.clone().requires_grad_(), weight.clone().requires_grad_()
        y = combine(o, order, w, k)
        y.backward(dy)
        grads.append((y.float(), o.grad.float(), w.grad.float()))
    for a, b in zip(*grads):
        # bf16 products summed in bf16 (index_add) vs an fp32 sum rounded once: ~bf16 epsilon apart.
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def moe_block_arms(monkeypatch, env: str, modes: tuple, x_scale: float = 1.0) -> list:
    """glm53-mini's MoE block under the fused policy, once per value of the setting `env`: [output,
    d x, every parameter's gradient] per mode, in fp32 (also tests/gpu/test_swiglu.py)."""
    import genolong.kernels as kernels
    from genolong.model import get_preset, ops
    from genolong.model.moe import MoE

    kernels.load()
    cfg = get_preset("glm53-mini")
    torch.manual_seed(0)
    block = MoE(cfg.hidden, cfg.moe, 3).cuda().to(torch.bfloat16)
    x = torch.randn(1, 4096, cfg.hidden, device="cuda", dtype=torch.bfloat16) * x_scale
    results = []
    for mode in modes:
        monkeypatch.setenv(env, mode)
        block.zero_grad()
        xi = x.clone().requires_grad_()
        with ops.policy("fused"):
            y = block(xi)
        y.float().square().mean().backward()
        results.append([y.float(), xi.grad.float()] + [p.grad.float() for p in block.parameters() if p.grad is not None])
    return results


def test_moe_block_with_the_triton_combine_matches_index_add(monkeypatch):
    for a, b in zip(*moe_block_arms(monkeypatch, "GENOLONG_MOE_COMBINE", ("index_add", "triton"))):
        assert ((a - b).norm() / b.norm().clamp_min(1e-12)).item() < 2e-2


def test_moe_block_with_the_read_side_dispatch_backward_matches_indexing(monkeypatch):
    # The rows are the same values; only d x is summed differently (fp32 over each token's k rows, one
    # rounding, against autograd's index backward), so everything downstream of it agrees to bf16.
    for a, b in zip(*moe_block_arms(monkeypatch, "GENOLONG_MOE_DISPATCH", ("index", "triton"))):
        assert ((a - b).norm() / b.norm().clamp_min(1e-12)).item() < 2e-2


def test_triton_dispatch_in_bf16_matches_indexing():
    from genolong.kernels.moe import combine as mc

    g = torch.Generator(device="cuda").manual_seed(1)
    tokens, k, hidden = 5000, 4, 512
    order = torch.sort(torch.randint(0, 64, (tokens * k,), generator=g, device="cuda").to(torch.int16), stable=True).indices
    x = torch.randn(tokens, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    drows = torch.randn(tokens * k, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    got = []
    for dispatch in (mc.dispatch_index, mc.dispatch):
        xi = x.clone().requires_grad_()
        rows = dispatch(xi, order, k)
        rows.backward(drows)
        got.append((rows, xi.grad.float()))
    assert torch.equal(got[0][0], got[1][0])
    assert ((got[0][1] - got[1][1]).norm() / got[0][1].norm()).item() < 1e-2
