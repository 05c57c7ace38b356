"""The device, dtype and kernel policy an evaluation command runs with: one rule for
eval-positional and eval-recall, checked before anything is loaded."""

from __future__ import annotations

import torch

from genolong.errors import GenolongError

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def pick_device(device: str | None) -> torch.device:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GenolongError(f"--device {device} but no CUDA GPU is visible; use --device cpu")
    return dev


def pick_dtype_and_kernels(dev: torch.device, dtype: str | None, kernels: str | None) -> tuple[str, str]:
    """(canonical dtype name, ops policy); loads the fused kernels unless the policy is "reference"."""
    from genolong.model import ops

    name = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    if name not in DTYPES:
        raise GenolongError(f"--dtype must be bfloat16 or float32, got {name!r}")
    policy = kernels or ("fused" if dev.type == "cuda" else "reference")
    if policy not in ops.POLICIES:
        raise GenolongError(f"--kernels must be one of {', '.join(ops.POLICIES)}, got {policy!r}")
    if policy != "reference":
        import genolong.kernels

        genolong.kernels.load()
    return name.replace("bf16", "bfloat16").replace("fp32", "float32"), policy
