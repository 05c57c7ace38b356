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
    assert len(text) == 3
    assert text[0] == "finetune step 1/5: first step"
    # The first step's time (compilation, warm-up) does not make the estimate: there is none yet.
    assert text[1] == "finetune step 1/5 (20%): loss 1.5000, 2,048 tok/s, 0.50 s/step, time left: after the next step"
    assert text[2].startswith("finetune step 5/5 (100%)") and "left" not in text[2]


def test_the_time_left_comes_from_the_steady_steps_and_the_gpu_says_it_compiles(monkeypatch):
    from genolong.train import progress_lines

    clock = iter([300.0, 301.0, 302.0])  # the first step ended at 300 s (it compiled); then 1 s a step
    monkeypatch.setattr(progress_lines.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    lines = StepLines(total=12, start=0, every_s=0, stream=out, compiling=True)
    for step in (1, 2, 3):
        lines.update(_record(step))
    text = out.getvalue().splitlines()
    assert text[0].startswith("finetune step 1/12: first step: compiling")
    assert text[-1].endswith("1.00 s/step, about 9 s left")


def test_the_progress_bar_estimates_from_the_steady_steps_too():
    from genolong.train.progress_lines import Progress

    bar = Progress(total=12, start=0, enabled=False)
    pace = bar._pace
    assert pace.update(1, now=300.0) is None
    assert pace.update(3, now=302.0) == 1.0


def test_every_step_when_the_interval_is_zero_and_a_resumed_run_counts_from_its_start():
    out = io.StringIO()
    lines = StepLines(total=10, start=7, every_s=0, stream=out)
    for step in (8, 9, 10):
        lines.update(_record(step))
    assert [line.split(":")[0] for line in out.getvalue().splitlines()] == ["finetune step 8/10"] + [
        f"finetune step {s}/10 ({s * 10}%)" for s in (8, 9, 10)
    ]
