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


def positions(first: int, n: int, device) -> torch.Tensor:
    """Query positions first .. first + n - 1 (int64), their start remembered on the host (`first_position`)."""
    t = torch.arange(first, first + n, device=device)
    t._genolong_first = int(first)  # (a Python attribute of this tensor object only: views and copies lack it)
    return t


def first_position(t: torch.Tensor) -> int:
    """t[0] of consecutive positions `t` as a Python int: from `positions` without reading the device
    (reading it is a host sync: two per indexer query chunk, 132 a 128k step, ~40 ms of idle GPU),
    else read (callers' own tensors)."""
    first = getattr(t, "_genolong_first", None)
    return int(t[0]) if first is None else first
