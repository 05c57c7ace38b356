"""FP8 (e4m3) checkpoint weights with block scales, dequantized on load.

GLM and DeepSeek publish FP8 checkpoints in one layout: a weight `W` stored as float8_e4m3fn
next to a float32 tensor `<name>_scale_inv` (for `x.weight` that is `x.weight_scale_inv`),
one scale per `block[0] x block[1]` tile of the last two dims (128 x 128 by default, from
`quantization_config.weight_block_size`). The real value of an element is `W[i, j] *
scale_inv[i // b0, j // b1]`; tiles at the right and bottom edges may be partial, so the scale
grid is `ceil(rows / b0) x ceil(cols / b1)`. Fused 3D expert tensors ([E, rows, cols]) carry a
scale grid per expert ([E, ceil(rows/b0), ceil(cols/b1)]). Scales may also be stored as
float8_e8m0fnu (power-of-two "UE8M0" scales); they are exact in float32.

genolong trains in bf16, so FP8 weights are dequantized once while loading (in float32, then
cast to the target dtype) and never kept in FP8.
"""

from __future__ import annotations

import math

import torch

from genolong.errors import GenolongError

DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)
# Static-activation FP8 checkpoints store per-tensor activation scales; dequantized weights do
# not need them, so the loader drops them (and says so).
ACTIVATION_SCALE_SUFFIXES = ("activation_scale", "input_scale")


def scale_key(key: str) -> str:
    """The name of the block-scale tensor that belongs to weight `key`."""
    return key + SCALE_SUFFIX


def is_scale_key(key: str) -> bool:
    return key.endswith(SCALE_SUFFIX)


def is_activation_scale_key(key: str) -> bool:
    return key.rsplit(".", 1)[-1].endswith(ACTIVATION_SCALE_SUFFIXES) and not is_scale_key(key)


def block_size_from_config(raw_config: dict) -> tuple[int, int] | None:
    """The FP8 block size named by a transformers config.json, or None when not FP8-quantized.

    A config without `quantization_config` may still hold FP8 tensors (hand-converted
    checkpoints); the loader then uses DEFAULT_BLOCK, checked against every scale grid's shape.
    """
    quant = raw_config.get("quantization_config")
    if quant is None and isinstance(raw_config.get("text_config"), dict):
        quant = raw_config["text_config"].get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method not in ("fp8", "FP8"):
        raise GenolongError(
            f"checkpoint quantization_config.quant_method is {method!r}; genolong loads only unquantized "
            "or block-FP8 ('fp8') checkpoints: dequantize it with its own tooling first"
        )
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise GenolongError(
            f"checkpoint FP8 format is {fmt!r}; genolong dequantizes only e4m3: convert the checkpoint first"
        )
    block = quant.get("weight_block_size")
    if block is None:
        return None
    if len(block) != 2 or min(block) <= 0:
        raise GenolongError(
            f"quantization_config.weight_block_size is {block!r}; expected two positive integers such as [128, 128]"
        )
    return int(block[0]), int(block[1])


def dequantize(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] | None = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
    name: str = "weight",
) -> torch.Tensor:
    """Real-valued tensor of an FP8 `weight` (..., rows, cols) with its block `scale_inv`.

    `block=None` means one scale per tensor (or per leading index). The product is formed in
    float32, because FP8 x scale in bf16 would round twice, then cast to `dtype`.
    """
    if weight.dtype not in FP8_DTYPES:
        raise GenolongError(f"{name} has dtype {weight.dtype}, not float8_e4m3fn; it has a scale but is not FP8")
    w = weight.to(torch.float32)
    s = scale_inv.to(torch.float32)
    # Per-tensor scaling is a scalar (or one scale per leading index with block=None); a 1x1
    # grid is a block grid and must fit the weight like any other.
    if block is None or s.dim() == 0:
        if s.numel() != 1 and s.shape != w.shape[: s.dim()]:
            raise GenolongError(f"{name}{SCALE_SUFFIX} has shape {tuple(s.shape)}; a per-tensor scale has one element")
        return (w * s.reshape(*s.shape, *([1] * (w.dim() - s.dim())))).to(dtype)
    if w.dim() < 2:
        raise GenolongError(f"{name} is {w.dim()}-D; block-scaled FP8 weights are at least 2-D")
    rows, cols = w.shape[-2:]
    b0, b1 = block
    expected = (*w.shape[:-2], math.ceil(rows / b0), math.ceil(cols / b1))
    if tuple(s.shape) != expected:
        raise GenolongError(
            f"{name}{SCALE_SUFFIX} has shape {tuple(s.shape)} but {name} {tuple(w.shape)} with "
            f"{b0}x{b1} blocks needs {expected}: check quantization_config.weight_block_size"
        )
    # Expand the scale grid to element resolution and crop the partial edge tiles.
    full = s.repeat_interleave(b0, dim=-2)[..., :rows, :].repeat_interleave(b1, dim=-1)[..., :cols]
    return (w * full).to(dtype)


def quantize(
    weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 quantization as the published checkpoints do it: per tile, scale so that the
    tile's max magnitude maps to e4m3's max (448). Returns (fp8 weight, float32 scale_inv).

    genolong never writes FP8 checkpoints for training; this exists so that tests (and users
    checking a converter) can build an FP8 checkpoint from known weights.
    """
    w = weight.to(torch.float32)
    rows, cols = w.shape[-2:]
    b0, b1 = block
    gr, gc = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = torch.zeros(*w.shape[:-2], gr * b0, gc * b1, dtype=torch.float32)
    padded[..., :rows, :cols] = w
    tiles = padded.unflatten(-1, (gc, b1)).unflatten(-3, (gr, b0))  # [..., gr, b0, gc, b1]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., gr, gc]
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    # An all-zero tile gets scale 1 so that it dequantizes to exact zeros instead of NaN.
    scale_inv = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    q = (tiles / scale_inv[..., :, None, :, None]).clamp(-fp8_max, fp8_max)
    q = q.flatten(-2).flatten(-3, -2)[..., :rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv.contiguous()
