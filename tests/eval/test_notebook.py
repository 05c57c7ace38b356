"""notebooks/analysis.ipynb runs top to bottom on small eval outputs and a training log."""

from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from genolong.eval import markov
from genolong.eval.positional import Layout
from genolong.eval.run import Settings, evaluate
from genolong.train.metrics import StepRecord
from tests.eval.standins import GRULM, make_windows, scorer, spec

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "analysis.ipynb"


def write_log(run: Path, steps: int = 6) -> None:
    run.mkdir(parents=True)
    lines = []
    for i in range(1, steps + 1):
        rec = StepRecord(
            step=i, loss=1.5 - 0.05 * i, lr=1e-3, grad_norm=1.0, skipped=False, tokens=1024, valid_tokens=1000,
            step_time_s=0.5, tokens_per_s=2048.0 + i, model_tflops=0.1, hardware_tflops=0.12, mfu=None, hfu=None,
            peak_gpu_gib=None, reserved_gpu_gib=None, pinned_host_gib=None, nonfinite_total=0,
        )
        lines.append(rec.to_json())
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


KEEP_FIGURES = """
import matplotlib.pyplot as _plt
_shown = []
_show = _plt.show
def _keep(*a, **k):
    _shown.append(_plt.gcf())
    _show(*a, **k)
_plt.show = _keep
"""
LEGEND_CHECK = """
from matplotlib.backends.backend_agg import FigureCanvasAgg
_over = _total = 0
for _fig in _shown:
    FigureCanvasAgg(_fig)  # the inline backend has let go of its canvas after showing it
    _fig.canvas.draw()
    _r = _fig.canvas.get_renderer()
    for _ax in _fig.axes:
        _leg = _ax.get_legend()
        if _leg is not None:
            _total += 1
            _over += _leg.get_window_extent(_r).overlaps(_ax.get_window_extent(_r))
print(f"legends over their axes: {_over} of {_total}")
"""


def test_notebook_executes_on_small_outputs(tmp_path, monkeypatch):
    models = {"baseline": GRULM(0), "checkpoint": GRULM(1)}
    out = tmp_path / "eval" / "small"
    evaluate(
        Settings(Layout(256, 64, 64, controls=("truncated", "shuffled")), out, n_boot=100, progress=False),
        {"baseline": spec(), "checkpoint": spec()},
        lambda: iter(make_windows(4, 256)),
        lambda role: scorer(models[role]),
        echo=lambda _: None,
        markov=markov.fit([np.random.default_rng(0).integers(0, 4, 4000).astype(np.uint8)], [np.zeros(50, dtype=np.uint8)], max_order=2),
    )
    write_log(tmp_path / "runs" / "small")
    monkeypatch.setenv("GENOLONG_RUNS", str(tmp_path / "runs" / "small"))
    monkeypatch.setenv("GENOLONG_EVALS", str(out))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Around the notebook: keep every figure it shows, then measure whether a legend overlaps its axes.
    nb.cells.insert(0, nbformat.v4.new_code_cell(KEEP_FIGURES))
    nb.cells.append(nbformat.v4.new_code_cell(LEGEND_CHECK))
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "legends over their axes: 0 of " in text and "legends over their axes: 0 of 0" not in text, text[-300:]
    assert "run small: 6 steps, final training loss 1.2000 nats (1.7312 bits) per token" in text
    assert "WARNING: only 4 windows" in text
    assert "late_minus_early" in text and "long_range_late_shuffled" in text
    table = {line.split()[1]: line for line in text.splitlines() if line.startswith("bits/base:")}
    assert table["uniform"].split()[-1] == "2.0000" and "[" in table["markov"] and "[" in table["checkpoint"]
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2  # training panel + one positional panel


def test_the_notebooks_executed_copies_are_git_ignored():
    import subprocess

    root = NOTEBOOK.parents[1]
    ignored = subprocess.run(["git", "check-ignore", "-q", "notebooks/analysis-demo.ipynb"], cwd=root)
    kept = subprocess.run(["git", "check-ignore", "-q", "notebooks/analysis.ipynb"], cwd=root)
    assert ignored.returncode == 0 and kept.returncode == 1


def test_notebook_is_stored_without_outputs_and_says_how_to_run_it():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "jupyter execute notebooks/analysis.ipynb" in first.source
    assert "GENOLONG_RUNS" in first.source and "GENOLONG_EVALS" in first.source
