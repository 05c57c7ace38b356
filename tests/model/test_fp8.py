"""Block-FP8 dequantization: against an element-by-element formula, and against the originals."""

import pytest
import torch

from genolong.errors import GenolongError
from genolong.model import fp8


def _elementwise(weight: torch.Tensor, scale: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    """The published definition, one element at a time: W[i, j] * scale[i // b0, j // b1]."""
    rows, cols = weight.shape
    out = torch.empty(rows, cols)
    w = weight.float()
    for i in range(rows):
        for j in range(cols):
            out[i, j] = w[i, j] * scale[i // b0, j // b1]
    return out


@pytest.mark.parametrize("shape,block", [((20, 12), (8, 8)), ((17, 9), (8, 4)), ((16, 16), (16, 16))])
def test_dequantize_matches_elementwise_formula(shape, block):
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(*shape, generator=g) * 50).clamp(-440, 440).to(torch.float8_e4m3fn)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale = torch.rand(*grid, generator=g) + 0.1
    got = fp8.dequantize(weight, scale, block)
    assert torch.equal(got, _elementwise(weight, scale, *block))


def test_dequantize_edges_and_3d_experts():
    # 300 x 200 with 128 x 128 blocks: partial tiles on the bottom and right edges.
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 300, 200, generator=g) * 0.02
    q, s = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3, 2)
    d = fp8.dequantize(q, s)
    # Each element's own tile scale, by index arithmetic (gather), not by expanding the grid.
    rows, cols = torch.arange(300)[:, None] // 128, torch.arange(200)[None, :] // 128
    tile_scale = torch.stack([s[e][rows, cols] for e in range(3)])
    assert torch.equal(d, q.float() * tile_scale)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; values far below
    # the tile maximum fall into subnormals, whose absolute spacing is scale * 2^-9.
    assert ((d - w).abs() <= w.abs() / 16 + tile_scale * 2.0**-9).all()
    assert (d - w).abs().max() > 0  # it really went through FP8


def test_quantize_uses_full_e4m3_range_and_zero_tiles_stay_zero():
    w = torch.zeros(256, 256)
    w[:128, :128] = torch.linspace(-3, 3, 128 * 128).view(128, 128)
    q, s = fp8.quantize(w)
    assert q[:128, :128].float().abs().max() == 448
    assert torch.allclose(s[0, 0], torch.tensor(3 / 448))
    assert torch.equal(s[1, 1], torch.tensor(1.0))
    assert torch.equal(fp8.dequantize(q, s)[128:], torch.zeros(128, 256))


def test_dequantize_accepts_ue8m0_and_per_tensor_scales():
    q = torch.full((4, 4), 3.0).to(torch.float8_e4m3fn)
    ue8m0 = torch.tensor([[4.0]]).to(torch.float8_e8m0fnu)
    assert torch.equal(fp8.dequantize(q, ue8m0, (128, 128)), torch.full((4, 4), 12.0))
    assert torch.equal(fp8.dequantize(q, torch.tensor(0.5), None), torch.full((4, 4), 1.5))


def test_dequantize_refuses_wrong_scale_grid_and_non_fp8():
    q = torch.zeros(300, 200).to(torch.float8_e4m3fn)
    with pytest.raises(GenolongError, match=r"layers.3.w.weight_scale_inv has shape \(2, 2\).*needs \(3, 2\)"):
        fp8.dequantize(q, torch.ones(2, 2), (128, 128), name="layers.3.w.weight")
    with pytest.raises(GenolongError, match="not float8_e4m3fn"):
        fp8.dequantize(torch.zeros(4, 4), torch.ones(1, 1))


def test_block_size_from_config():
    assert fp8.block_size_from_config({}) is None
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 64]}
    assert fp8.block_size_from_config({"quantization_config": quant}) == (128, 64)
    assert fp8.block_size_from_config({"text_config": {"quantization_config": quant}}) == (128, 64)
    with pytest.raises(GenolongError, match="quant_method is 'awq'"):
        fp8.block_size_from_config({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(GenolongError, match="e5m2"):
        fp8.block_size_from_config({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}})
