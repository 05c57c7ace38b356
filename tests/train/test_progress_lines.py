"""Progress without a terminal: one plain line per step, throttled, first and last always."""

import io
from types import SimpleNamespace

from genolong.train.progress_lines import StepLines


def _record(step, loss=1.5):
    return SimpleNamespace(step=step, loss=loss, tokens_per_s=2048.0, step_time_s=0.5, peak_gpu_gib=None, skipped=False)


def test_first_and_last_step_always_and_nothing_in_between_within_the_interval():
    out = io.StringIO()
    lines = StepLines(total=5, start=0, every_s=3600, stream=out)
    for step in range(1, 6):
        lines.update(_record(step))
    text = out.getvalue().splitlines()
    assert len(text) == 2
    assert text[0] == "finetune step 1/5 (20%): loss 1.5000, 2,048 tok/s, 0.50 s/step, about 2 s left"
    assert text[1].startswith("finetune step 5/5 (100%)") and "left" not in text[1]


def test_every_step_when_the_interval_is_zero_and_a_resumed_run_counts_from_its_start():
    out = io.StringIO()
    lines = StepLines(total=10, start=7, every_s=0, stream=out)
    for step in (8, 9, 10):
        lines.update(_record(step))
    assert [line.split(":")[0] for line in out.getvalue().splitlines()] == [f"finetune step {s}/10 ({s * 10}%)" for s in (8, 9, 10)]
