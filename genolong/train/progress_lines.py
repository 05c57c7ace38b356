"""Training progress: a rich progress bar on a terminal (`Progress`), plain lines elsewhere (`StepLines`).

A rich progress bar drawn into a pipe, a log file or CI output prints nothing until it stops,
so a long run looks dead. Without a terminal, `--progress` prints one line per step instead,
at most one every `every_s` seconds (plus the first and the last step):

    finetune step 40/100 (40%): loss 1.2345, 1,234 tok/s, 0.41 s/step, about 25 s left

The time left comes from the steps after the first (which compiles kernels on a GPU, and says so).
"""

from __future__ import annotations

import sys
import time

from genolong.train.metrics import StepRecord

# What the first step of an invocation is doing besides training (it can take minutes on a fresh GPU
# machine: torch.compile and Triton / TileLang builds and autotuning). Its time says nothing about
# the steps after it, so no time left is estimated from it.
FIRST_STEP_GPU = "first step: compiling and autotuning the kernels (minutes on a fresh machine; cached afterwards)"
FIRST_STEP_CPU = "first step"


class Pace:
    """Seconds per step from the steady steps only: measured from the end of the first step seen."""

    def __init__(self) -> None:
        self._first: tuple[float, int] | None = None  # (time, step) when the first step seen ended

    def update(self, step: int, now: float | None = None) -> float | None:
        now = time.perf_counter() if now is None else now
        if self._first is None:
            self._first = (now, step)
            return None
        t_first, step_first = self._first
        return (now - t_first) / (step - step_first) if step > step_first else None


def time_left(per_step: float | None, steps_left: int) -> str | None:
    if steps_left <= 0:
        return None
    if per_step is None:
        return "time left: after the next step"
    return f"about {_duration(per_step * steps_left)} left"


class StepLines:
    def __init__(self, total: int, start: int, every_s: float = 10.0, stream=None, compiling: bool = False):
        self._total, self._start, self._every = total, start, every_s
        self._stream = stream or sys.stdout
        self._pace = Pace()
        self._last: float | None = None
        if start < total:
            print(f"finetune step {start + 1}/{total}: {FIRST_STEP_GPU if compiling else FIRST_STEP_CPU}", file=self._stream, flush=True)

    def update(self, record) -> None:
        now = time.perf_counter()
        per_step = self._pace.update(record.step, now)
        last_step = record.step >= self._total
        if not (self._last is None or last_step or now - self._last >= self._every):
            return
        self._last = now
        parts = [f"loss {record.loss:.4f}", f"{record.tokens_per_s:,.0f} tok/s", f"{per_step or record.step_time_s:.2f} s/step"]
        if record.peak_gpu_gib is not None:
            parts.append(f"peak {record.peak_gpu_gib:.1f} GiB")
        if record.skipped:
            parts.append("skipped (non-finite)")
        left = time_left(per_step, self._total - record.step)
        if left:
            parts.append(left)
        percent = 100 * record.step // max(self._total, 1)
        print(f"finetune step {record.step}/{self._total} ({percent}%): {', '.join(parts)}", file=self._stream, flush=True)

    def close(self) -> None:
        pass


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """A rich progress bar with the latest loss, tokens/s, MFU and memory (off: no output at all)."""

    def __init__(self, total: int, start: int, enabled: bool, compiling: bool = False):
        self._bar = None
        self._total = total
        self._pace = Pace()
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
        from rich.progress import Progress as RichProgress

        # No rich TimeRemainingColumn: it extrapolates from the first step, which compiles (minutes).
        self._bar = RichProgress(TextColumn("[bold]finetune"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"))
        self._task = self._bar.add_task("train", total=total, completed=start, info=FIRST_STEP_GPU if compiling else FIRST_STEP_CPU)
        self._bar.start()

    def update(self, record: StepRecord) -> None:
        per_step = self._pace.update(record.step)
        if self._bar is None:
            return
        parts = [f"loss {record.loss:.4f}", f"{record.tokens_per_s:,.0f} tok/s"]
        left = time_left(per_step, self._total - record.step)
        if left:
            parts.insert(0, left)
        if record.mfu is not None:
            parts.append(f"MFU {100 * record.mfu:.1f}%")
        if record.peak_gpu_gib is not None:
            parts.append(f"peak {record.peak_gpu_gib:.1f} GiB")
        if record.pinned_host_gib:
            parts.append(f"pinned {record.pinned_host_gib:.1f} GiB")
        if record.expert_load_max:
            parts.append(f"busiest expert {max(record.expert_load_max.values()):.1f}x mean")
        if record.indexer_loss is not None:
            parts.append(f"indexer KL {record.indexer_loss:.4f}" + (" (warm-up)" if record.indexer_phase == "warmup" else ""))
        if record.indexer_recall is not None:
            parts.append(f"recall {record.indexer_recall:.3f}")
        if record.skipped:
            parts.append("[red]skipped (non-finite)")
        self._bar.update(self._task, completed=record.step, info="  ".join(parts))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def progress_display(total: int, start: int, enabled: bool, compiling: bool = False):
    """The progress bar on a terminal, step lines elsewhere, nothing when disabled. `compiling`: the
    first step builds kernels (on the GPU), and the display says so while it runs."""
    from rich.console import Console

    if enabled and not Console().is_terminal:
        return StepLines(total, start, compiling=compiling)
    return Progress(total, start, enabled, compiling=compiling)
