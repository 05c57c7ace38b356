"""fp8 storage of saved layer inputs: float8_e4m3fn with one float32 scale per row.

A row is the last dimension: for a layer input [B, T, 4, hidden] the hidden vector of one mHC
stream of one token. Its scale is amax(|row|) / 448 (e4m3's largest finite value), so the row's
largest element maps to 448 and the others keep e4m3's 3 mantissa bits relative to themselves:
|x - dequantize(quantize(x))| <= 2^-4 |x| for elements that quantize to a normal e4m3 value
(|x| >= 2^-6 scale) and <= 2^-10 scale below that (e4m3's subnormal spacing is 2^-9), before the
cast back to the input's dtype. An all-zero row gets scale 1 and comes back as zeros.

Both directions run over row chunks of at most `CHUNK_ELEMENTS` elements: the float32 temporary of
a whole 1M-token layer input would be 8 GiB, more than the GPU has to spare when it is stored.

`pack_fp8` / `unpack_fp8` put one tensor's scales and fp8 values into one flat uint8 tensor (the
scales first, so that their float32 view starts 4-byte aligned): what genolong.train.offload keeps on
the device or copies to a host buffer in its fp8 storage mode.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_BYTES = 4
CHUNK_ELEMENTS = 1 << 24  # float32 temporaries of at most 64 MiB


def row_count(shape: torch.Size | tuple[int, ...]) -> int:
    """Rows (one scale each) of a tensor of `shape`: every dimension but the last."""
    rows = 1
    for n in tuple(shape)[:-1]:
        rows *= n
    return rows


def packed_nbytes(shape: torch.Size | tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` in fp8 storage: one byte an element plus 4 a row."""
    return row_count(shape) * (tuple(shape)[-1] + SCALE_BYTES)


def quantize_rows(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (floating) -> (q [..., D] float8_e4m3fn, scale [..., 1] float32) with x ~ q * scale.

    out: (q, scale) tensors to write into (any shapes with those numels)."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if out is None:
        out = (torch.empty(rows.shape, dtype=FP8, device=x.device), torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device))
    q, scale = out[0].view(rows.shape), out[1].view(rows.shape[0], 1)
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    for a in range(0, rows.shape[0], step):
        r = rows[a : a + step].float()
        s = r.abs().amax(dim=-1, keepdim=True).div_(FP8_MAX)
        s.masked_fill_(s == 0, 1.0)
        # Not in place: `float()` of a float32 x is x itself. The clamp: amax / (amax / 448) can round
        # to a hair above 448, and e4m3fn has no infinity.
        q[a : a + step] = (r / s).clamp_(-FP8_MAX, FP8_MAX)
        scale[a : a + step] = s
    return q.view(x.shape), scale.view(*x.shape[:-1], 1)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [..., D] float8_e4m3fn, scale [..., 1] float32) -> q * scale as a new `dtype` tensor [..., D]."""
    width = q.shape[-1]
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    rows, scales, dst = q.reshape(-1, width), scale.reshape(-1, 1), out.view(-1, width)
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    for a in range(0, rows.shape[0], step):
        dst[a : a + step] = rows[a : a + step].float().mul_(scales[a : a + step])
    return out


def _views(packed: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) views of a flat uint8 `packed` of packed_nbytes(shape) bytes: scales, then values."""
    n_rows = row_count(shape)
    scale = packed[: SCALE_BYTES * n_rows].view(torch.float32).view(n_rows, 1)
    q = packed[SCALE_BYTES * n_rows : packed_nbytes(shape)].view(FP8).view(n_rows, shape[-1])
    return q, scale


def pack_fp8(x: torch.Tensor) -> torch.Tensor:
    """x quantized into one flat uint8 tensor on x's device (scales, then fp8 values)."""
    packed = torch.empty(packed_nbytes(x.shape), dtype=torch.uint8, device=x.device)
    quantize_rows(x, out=_views(packed, x.shape))
    return packed


def unpack_fp8(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `shape` and `dtype` that pack_fp8 packed into `packed` (a new tensor on packed's device)."""
    q, scale = _views(packed, shape)
    return dequantize_rows(q, scale, dtype).view(shape)


def quantizable(t: torch.Tensor) -> bool:
    """Whether fp8 storage halves (or better) `t`: a floating tensor of 2+ bytes an element with rows."""
    return t.is_floating_point() and t.element_size() >= 2 and t.dim() >= 1 and t.shape[-1] > 0 and not t.is_complex()
