"""Training progress where there is no terminal: plain lines, not a progress bar.

A rich progress bar drawn into a pipe, a log file or CI output prints nothing until it stops,
so a long run looks dead. Without a terminal, `--progress` prints one line per step instead,
at most one every `every_s` seconds (plus the first and the last step):

    finetune step 40/100 (40%): loss 1.2345, 1,234 tok/s, 0.41 s/step, about 25 s left

The time left comes from the steps after the first (which compiles kernels on a GPU, and says so).
"""

from __future__ import annotations

import sys
import time

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


def progress_display(total: int, start: int, enabled: bool, compiling: bool = False):
    """The progress bar on a terminal, step lines elsewhere, nothing when disabled. `compiling`: the
    first step builds kernels (on the GPU), and the display says so while it runs."""
    from rich.console import Console

    from genolong.train.metrics import Progress

    if enabled and not Console().is_terminal:
        return StepLines(total, start, compiling=compiling)
    return Progress(total, start, enabled, compiling=compiling)
