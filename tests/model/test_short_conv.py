"""KDA's short convolution op ("kda_short_conv"): the reference against the convolution written out."""

import torch

from genolong.model import GenoLongForCausalLM, get_preset, ops
from genolong.model.kda import short_conv_reference


def test_reference_is_silu_of_the_causal_depthwise_sum():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    got = short_conv_reference(x, w)
    # y[t, c] = silu(sum_k w[c, k] * x[t - 3 + k, c]), zeros before the sequence start.
    padded = torch.cat([torch.zeros(2, 3, 5, dtype=torch.float64), x], dim=1)
    want = torch.nn.functional.silu(sum(w[:, k] * padded[:, k : k + 9] for k in range(4)))
    assert torch.allclose(got, want)


def test_reference_computes_in_the_weight_dtype_and_returns_the_input_dtype():
    x = torch.randn(1, 6, 3).bfloat16()
    w = torch.randn(3, 4)
    got = short_conv_reference(x, w)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, short_conv_reference(x.float(), w).bfloat16())


def test_the_kda_module_calls_the_op_with_its_weight_and_gets_its_gradient():
    torch.manual_seed(0)
    layer = GenoLongForCausalLM(get_preset("tiny")).model.layers[0].self_attn
    qkv = torch.randn(1, 7, layer.conv1d.weight.shape[0], requires_grad=True)
    ops.reset_audit()
    layer.short_conv(qkv).sum().backward()
    assert ops.audit() == {(0, "kda_short_conv"): ops.REFERENCE}
    assert layer.conv1d.weight.grad is not None and layer.conv1d.weight.grad.abs().sum() > 0
    layer.zero_grad(set_to_none=True)
