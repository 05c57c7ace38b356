"""Training progress where there is no terminal: plain lines, not a progress bar.

A rich progress bar drawn into a pipe, a log file or CI output prints nothing until it stops,
so a long run looks dead. Without a terminal, `--progress` prints one line per step instead,
at most one every `every_s` seconds (plus the first and the last step):

    finetune step 40/100 (40%): loss 1.2345, 1,234 tok/s, 0.41 s/step, about 25 s left
"""

from __future__ import annotations

import sys
import time


class StepLines:
    def __init__(self, total: int, start: int, every_s: float = 10.0, stream=None):
        self._total, self._start, self._every = total, start, every_s
        self._stream = stream or sys.stdout
        self._first: tuple[float, int] | None = None  # (time, step) of the first step seen
        self._last: float | None = None

    def update(self, record) -> None:
        now = time.perf_counter()
        if self._first is None:
            self._first = (now, record.step)
        last_step = record.step >= self._total
        if not (self._last is None or last_step or now - self._last >= self._every):
            return
        self._last = now
        # The pace since the first step (which also pays for warm-up), else that step's own time.
        t_first, step_first = self._first
        per_step = (now - t_first) / (record.step - step_first) if record.step > step_first else record.step_time_s
        parts = [f"loss {record.loss:.4f}", f"{record.tokens_per_s:,.0f} tok/s", f"{per_step:.2f} s/step"]
        if record.peak_gpu_gib is not None:
            parts.append(f"peak {record.peak_gpu_gib:.1f} GiB")
        if record.skipped:
            parts.append("skipped (non-finite)")
        if not last_step:
            parts.append(f"about {_duration(per_step * (self._total - record.step))} left")
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


def progress_display(total: int, start: int, enabled: bool):
    """The progress bar on a terminal, step lines elsewhere, nothing when disabled."""
    from rich.console import Console

    from genolong.train.metrics import Progress

    if enabled and not Console().is_terminal:
        return StepLines(total, start)
    return Progress(total, start, enabled)
