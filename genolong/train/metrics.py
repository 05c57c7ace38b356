"""Per-step records and where they go: metrics.jsonl and TensorBoard (if installed); the progress
display is genolong.train.progress_lines.

One JSON line per step, written and flushed as the step ends, so a crashed run keeps its log up
to the crash; on resume the log is cut back to the checkpoint's step before new lines are added,
so the file always reads as one uninterrupted run. Field meanings are in docs/training.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class StepRecord:
    step: int  # 1-based: the number of optimizer steps taken after this one
    loss: float  # mean loss over the step's valid tokens (nan when non-finite)
    lr: float
    grad_norm: float  # global norm before clipping
    skipped: bool  # non-finite loss or gradient: no update was made
    tokens: int  # input tokens of the step, every rank's, each counted once (batch x seq)
    valid_tokens: int  # targets counted in the loss (non-N)
    step_time_s: float
    tokens_per_s: float
    model_tflops: float  # model FLOPs of the step / 1e12
    hardware_tflops: float  # with recompute and loss-head recompute
    mfu: float | None  # model FLOP/s over the device's dense bf16 peak; None when the peak is unknown
    hfu: float | None
    peak_gpu_gib: float | None  # torch.cuda.max_memory_allocated during the step
    reserved_gpu_gib: float | None
    pinned_host_gib: float | None  # peak host bytes holding offloaded layer inputs and kept DSA results during the step
    nonfinite_total: int  # skipped steps so far in the run
    aux_loss: float | None = None  # expert balance loss added to the objective (all MoE layers); None = off
    # Per MoE layer ("3": value): tokens routed to the busiest / idlest expert over the mean per
    # expert in this step. No capacity limit exists, so no token is dropped. None without MoE.
    expert_load_max: dict[str, float] | None = None
    expert_load_min: dict[str, float] | None = None
    # The DSA indexer (docs/training.md "The indexer"); None while it is frozen / not measured.
    indexer_phase: str | None = None  # "warmup" (only the indexer trains, dense targets) or "sparse"
    indexer_loss: float | None = None  # KL per query, the step's mean, averaged over the DSA layers
    indexer_loss_layers: dict[str, float] | None = None  # the same per DSA layer index
    indexer_recall: float | None = None  # dense attention mass inside the selection, sampled queries
    indexer_recall_layers: dict[str, float] | None = None

    def to_json(self) -> str:
        return json.dumps({k: _clean(v) for k, v in asdict(self).items()})


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no nan/inf; "nan" keeps the line parseable by any reader
    return v


class JsonlLog:
    def __init__(self, path: Path, truncate_after_step: int | None = None):
        self.path = path
        if truncate_after_step is not None and path.exists():
            kept = [
                line
                for line in path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= truncate_after_step
            ]
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        elif truncate_after_step is None and path.exists():
            path.unlink()
        self._f = path.open("a", encoding="utf-8")

    def write(self, record: StepRecord) -> None:
        self._f.write(record.to_json() + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardLog:
    """Scalars to RUN_DIR/tensorboard when `tensorboard` is installed; silently nothing otherwise."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, record: StepRecord) -> None:
        if self.writer is None:
            return
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "hfu", "peak_gpu_gib", "pinned_host_gib", "aux_loss"):
            value = getattr(record, key)
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(f"train/{key}", value, record.step)
        for key, name in (("expert_load_max", "load_max"), ("expert_load_min", "load_min")):
            for layer, value in (getattr(record, key) or {}).items():
                self.writer.add_scalar(f"experts/{name}/layer_{int(layer):02d}", value, record.step)
        for key in ("indexer_loss", "indexer_recall"):
            value = getattr(record, key)
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(f"indexer/{key[8:]}", value, record.step)
            for layer, v in (getattr(record, f"{key}_layers") or {}).items():
                self.writer.add_scalar(f"indexer/{key[8:]}_layer{layer}", v, record.step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
