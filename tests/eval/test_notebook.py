"""notebooks/analysis.ipynb runs top to bottom on small eval outputs and a training log."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

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


def test_notebook_executes_on_small_outputs(tmp_path, monkeypatch):
    models = {"baseline": GRULM(0), "checkpoint": GRULM(1)}
    out = tmp_path / "eval" / "small"
    evaluate(
        Settings(Layout(256, 64, 64), out, n_boot=100, progress=False),
        {"baseline": spec(), "checkpoint": spec()},
        lambda: iter(make_windows(4, 256)),
        lambda role: scorer(models[role]),
        echo=lambda _: None,
    )
    write_log(tmp_path / "runs" / "small")
    monkeypatch.setenv("GENOLONG_RUNS", str(tmp_path / "runs" / "small"))
    monkeypatch.setenv("GENOLONG_EVALS", str(out))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "run small: 6 steps, final loss 1.2000" in text
    assert "late_minus_early" in text
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2  # training panel + one positional panel


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
