"""The chunked grouped-GEMM MoE path against the model's reference, on the CPU."""

import pytest
import torch

from genolong.kernels.moe import grouped as moe
from genolong.model.moe import moe_experts_reference


def _case(n=96, experts=8, k=3, hidden=32, inter=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    # Skewed routing, like real data: expert 0 takes most tokens, the last two none at all.
    probs = torch.tensor([8.0] + [1.0] * (experts - 3) + [0.0, 0.0])
    idx = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(n)])
    w = torch.rand(n, k, generator=g, dtype=torch.float64)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=torch.float64) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g, dtype=torch.float64) * inter**-0.5
    return x, idx, w, gate_up, down


@pytest.mark.parametrize("chunk", [7, 32, 1000])
def test_chunked_grouped_path_matches_reference_with_gradients(chunk):
    x, idx, w, gate_up, down = _case()
    leaves = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    ref = moe_experts_reference(leaves[0], idx, w, leaves[1], leaves[2], swiglu_limit=1.5)
    ref.sum().backward()
    mine = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    got = moe.experts_grouped(mine[0], idx, w, mine[1], mine[2], swiglu_limit=1.5, chunk_tokens=chunk, mm=moe.grouped_mm_loop)
    got.sum().backward()
    torch.testing.assert_close(got, ref)
    for a, b in zip(mine, leaves):
        torch.testing.assert_close(a.grad, b.grad)


def test_torch_grouped_mm_forward_on_cpu():
    x, idx, w, gate_up, down = (t.float() if t.is_floating_point() else t for t in _case())
    ref = moe_experts_reference(x, idx, w, gate_up, down, swiglu_limit=10.0)
    got = moe.experts_grouped(x, idx, w, gate_up, down, swiglu_limit=10.0, chunk_tokens=40)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_chunk_size_follows_the_budget():
    assert moe.chunk_tokens_for(4, 512, 256, 2) * 4 * (2 * (512 + 768 + 512) + 4 * 512) <= moe.CHUNK_BUDGET_BYTES
    assert moe.chunk_tokens_for(4, 512, 256, 2, budget_bytes=1) == 1


@pytest.mark.parametrize("case", ["random", "empty_experts", "one_expert", "no_rows"])
def test_expert_offsets_are_the_cumulative_counts_per_expert(case):
    gen = torch.Generator().manual_seed(3)
    n_experts = 16
    flat = {
        "random": torch.randint(0, n_experts, (1000,), generator=gen),
        "empty_experts": torch.randint(0, 5, (300,), generator=gen) * 3,  # experts 1, 2, 4, 5, ... and 15 unused
        "one_expert": torch.full((64,), 7),
        "no_rows": torch.zeros(0, dtype=torch.long),
    }[case]
    want = torch.cumsum(torch.bincount(flat, minlength=n_experts), 0).to(torch.int32)
    wide = torch.sort(flat, stable=True)
    narrow = torch.sort(moe.sort_keys(flat, n_experts), stable=True)
    assert torch.equal(narrow.indices, wide.indices)  # the narrow keys give the same stable order
    for keys in (wide.values, narrow.values):
        got = moe.expert_offsets(keys, n_experts)
        assert got.dtype == torch.int32 and torch.equal(got, want)


def test_sort_keys_are_the_narrowest_integers_that_hold_the_experts():
    flat = torch.tensor([0, 5, 2], dtype=torch.int64)
    assert moe.sort_keys(flat, 288).dtype == torch.int16  # GLM-5.3-Flash's 288 experts
    assert torch.equal(moe.sort_keys(flat, 288).long(), flat)
    assert moe.sort_keys(flat, 40000).dtype == torch.int32
