"""The plan's per-layer backward rule (genolong.train.plan.backward_peaks) against the CPU's own
measurement of a checkpointed backward (genolong.train.census.backward_working_set): the terms
whose ops are the same on the CPU as on the GPU, each expected value written out by hand."""

import pytest
import torch

from genolong.train.census import backward_working_set

A = 2  # bf16


def test_the_measurement_is_exact_on_a_call_whose_working_set_is_known():
    # sigmoid keeps its output; its backward holds the incoming gradient, that output and the gradient it returns.
    x = torch.randn(2048, 256, dtype=torch.bfloat16, requires_grad=True)
    assert backward_working_set(torch.sigmoid, x, []) == 3 * 2048 * 256 * A


def test_a_dense_mlp_holds_its_items_the_gradient_in_and_the_swiglu_gradients():
    from genolong.model.mlp import DenseMLP

    torch.manual_seed(0)
    s, h, inter = 8192, 512, 192  # the tp=8 cell's proportions (4096 : 1536), weights small beside the tokens
    mlp = DenseMLP(h, inter, 10.0).to(torch.bfloat16)
    x = torch.randn(1, s, h, dtype=torch.bfloat16, requires_grad=True)
    got = backward_working_set(mlp, x, list(mlp.parameters()))
    # gradient in + gate, up, clamp(gate), silu, clamp(up), product + the product's two gradients
    assert got == pytest.approx(s * (A * h + 6 * A * inter + 2 * A * inter), rel=0.05)


def test_the_grouped_moe_holds_the_experts_gate_up_gradient_twice_across_its_chunks():
    # Many experts, few tokens: the weight gradients dominate. In chunks, autograd adds each chunk's
    # gate/up weight gradient to a running sum that becomes the parameter's gradient after the last
    # chunk: the sum so far, the newest chunk's and their sum are held at once, two copies more than
    # the single-chunk run holds (its gradient as it is made, which this measurement counts).
    from genolong.kernels.moe.grouped import experts_grouped, grouped_mm

    torch.manual_seed(0)
    e, h, inter, k, tokens = 16, 256, 128, 2, 64
    gate_up = (torch.randn(e, 2 * inter, h) * 0.02).bfloat16().requires_grad_()
    down = (torch.randn(e, h, inter) * 0.02).bfloat16().requires_grad_()
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k)
    x = torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)

    def run(chunk):
        return backward_working_set(lambda xx: experts_grouped(xx, idx, w, gate_up, down, swiglu_limit=10.0, chunk_tokens=chunk,
                                                               mm=grouped_mm), x, [gate_up, down])

    gate_up_grad = e * 2 * inter * h * A
    assert run(tokens // 4) - run(tokens) == pytest.approx(2 * gate_up_grad, rel=0.1)
