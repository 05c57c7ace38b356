"""What eval-positional and eval-recall share besides the models (genolong.eval.models): one rule for
the device, dtype, kernel policy and loss chunk (`Runtime`, checked before anything is loaded), the
checks of their common options, and the windows of a split (`split_windows`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from genolong.errors import GenolongError
from genolong.units import parse_length

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


@dataclass(frozen=True)
class Runtime:
    """How an evaluation command scores: device, dtype (canonical name), ops policy, and tokens per
    loss chunk (None: ~256 MiB of fp32 hidden states, genolong.eval.dnaloss.auto_chunk_tokens)."""

    device: torch.device
    dtype: str
    policy: str
    chunk_tokens: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def loss_chunk_tokens(loss_chunk: str | None) -> int | None:
    """`--loss-chunk` in tokens (None: the automatic size)."""
    return parse_length(loss_chunk, "--loss-chunk") if loss_chunk is not None else None


def settle(dev: torch.device, dtype: str | None, kernels: str | None, chunk_tokens: int | None) -> Runtime:
    """The Runtime of `--dtype` and `--kernels` on `dev` (`pick_device`, or a rank's own GPU); loads
    the fused kernels unless the policy is "reference"."""
    name, policy = pick_dtype_and_kernels(dev, dtype, kernels)
    return Runtime(dev, name, policy, chunk_tokens)


def check_sampling(bootstrap: int, max_n_fraction: float) -> None:
    """The checks of the options every evaluation command has for its windows and intervals."""
    if bootstrap < 1:
        raise GenolongError(f"--bootstrap must be at least 1, got {bootstrap}")
    if not 0.0 <= max_n_fraction < 1.0:
        raise GenolongError(f"--max-n-fraction must be in [0, 1), got {max_n_fraction}")


def check_data(data: Path) -> None:
    if not Path(data).is_dir():
        raise GenolongError(f"--data {data}: no such directory; pass the --out directory of `genolong prepare`")


@dataclass
class SplitWindows:
    """The windows of one split of a prepared genome: `tiles()` restarts the tiling; `identity` is
    what the numbers depend on (the source genome and the split's records, not where the directory
    lives), for the partial results' fingerprint."""

    tiles: Callable[[], Iterable]
    identity: dict[str, Any]


def split_windows(
    pg, data: Path, split: str, seq: int, seq_text: str, *, max_n_fraction: float, max_windows: int | None = None
) -> SplitWindows:
    """`pg.records(split)` tiled into windows of `seq` tokens; GenolongError naming the records when
    no window has few enough N bases."""
    from genolong.data import tile_windows

    records = list(pg.records(split))

    def tiles():
        return tile_windows(pg, split, seq, max_windows=max_windows, max_n_fraction=max_n_fraction)

    if next(iter(tiles()), None) is None:
        raise GenolongError(
            f"the {split} split of {data} has no window of {seq_text} with at most {max_n_fraction:.0%} N "
            f"(records: {', '.join(f'{n} {length:,} bp' for n, length in records)}): use a smaller --seq or a larger --max-n-fraction"
        )
    identity = {"sha256": pg.manifest.get("source", {}).get("sha256"), split: [list(r) for r in records]}
    return SplitWindows(tiles, identity)
