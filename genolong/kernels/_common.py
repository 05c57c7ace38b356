"""Helpers shared by the fused implementations: device checks and output allocation."""

from __future__ import annotations

import torch

from genolong.model.ops import KernelUnsupported

# Kernel tests set this so that every output buffer a wrapper allocates starts as NaN (floats) or
# as POISON_INT (integers): an element the kernel forgot to write then shows up in the comparison.
POISON = False
POISON_INT = -7


def empty(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, or a poisoned buffer while POISON is set."""
    if not POISON:
        return torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else POISON_INT
    return torch.full(shape, fill, dtype=dtype, device=device)


def require_cuda(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_cuda:
            raise KernelUnsupported(f"needs CUDA tensors, got a tensor on {t.device}")


def require_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> None:
    if t.dtype not in dtypes:
        raise KernelUnsupported(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
