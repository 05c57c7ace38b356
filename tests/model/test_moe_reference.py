"""Gradients of the "moe_experts" reference against a per-token loop (its outputs: test_modules.py)."""

import torch
import torch.nn.functional as F

from genolong.model.moe import moe_experts_reference


def _per_token(x, idx, w, gate_up, down, limit):
    rows = []
    for i in range(x.shape[0]):
        acc = 0
        for j in range(idx.shape[1]):
            gate, up = (gate_up[idx[i, j]] @ x[i]).chunk(2)
            h = F.silu(torch.minimum(gate, torch.tensor(limit, dtype=x.dtype))) * up.clamp(-limit, limit)
            acc = acc + w[i, j] * (down[idx[i, j]] @ h)
        rows.append(acc)
    return torch.stack(rows)


def test_moe_experts_reference_gradients_match_per_token_loop():
    gen = torch.Generator().manual_seed(11)
    n, d, inner, experts, k, limit = 40, 12, 10, 6, 2, 1.5
    leaves = [
        torch.randn(n, d, generator=gen, dtype=torch.float64),
        torch.rand(n, k, generator=gen, dtype=torch.float64),
        torch.randn(experts, 2 * inner, d, generator=gen, dtype=torch.float64),
        torch.randn(experts, d, inner, generator=gen, dtype=torch.float64),
    ]
    leaves = [t.requires_grad_() for t in leaves]
    idx = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(n)])  # expert 5 unused
    dy = torch.randn(n, d, generator=gen, dtype=torch.float64)
    x, w, gate_up, down = leaves
    got = torch.autograd.grad(moe_experts_reference(x, idx, w, gate_up, down, swiglu_limit=limit), leaves, dy)
    want = torch.autograd.grad(_per_token(x, idx, w, gate_up, down, limit), leaves, dy)
    for name, a, b in zip(("x", "topk_w", "gate_up_proj", "down_proj"), got, want):
        assert torch.allclose(a, b, atol=1e-11), name
    assert not got[2][5].any() and not got[3][5].any(), "the unused expert got a gradient"
