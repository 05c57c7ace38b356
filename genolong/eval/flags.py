"""The command-line options eval-positional and eval-recall share, declared once (their meaning is
genolong.eval.runtime's)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

MaxNFraction = Annotated[float, typer.Option(help="Skip windows with a larger fraction of N bases.")]
Bootstrap = Annotated[int, typer.Option(help="Bootstrap replicates (resampling windows) for the 95% intervals.")]
Device = Annotated[Optional[str], typer.Option(help="cuda or cpu (default: cuda if available).")]
Dtype = Annotated[Optional[str], typer.Option(help="bfloat16 or float32 (default: bfloat16 on CUDA, float32 on CPU).")]
Kernels = Annotated[Optional[str], typer.Option(help="Ops policy: fused, auto or reference (default: fused on CUDA, reference on CPU).")]
LossChunk = Annotated[
    Optional[str], typer.Option(help="Tokens per loss chunk, e.g. 2k or 4096, as in finetune (default: ~256 MiB of fp32 hidden states).")
]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Discard partial results in --out from another evaluation.")]
Progress = Annotated[bool, typer.Option(help="Show a progress bar over windows (stderr).")]
