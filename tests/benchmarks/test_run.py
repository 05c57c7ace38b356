"""benchmarks/run.py: every registered benchmark exists, a run appends one stamped row holding what
the benchmark wrote and printed, and bad invocations are refused in one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import run

ROOT = Path(__file__).resolve().parents[2]


def test_every_registered_script_exists_and_nothing_unregistered_is_a_benchmark():
    for name, bench in run.REGISTRY.items():
        assert (ROOT / "benchmarks" / bench.script).is_file(), name
        assert bench.device in ("gpu", "gpus", "cpu"), name
    registered = {b.script for b in run.REGISTRY.values()}
    # profile_step's helpers, bench_real_layers' plan side and the runner itself are the only other modules.
    helpers = {"run.py", "__init__.py", "op_sites.py", "sync_census.py", "trace_gaps.py", "real_layers_plan.py"}
    assert {p.name for p in (ROOT / "benchmarks").glob("*.py")} == registered | helpers


def test_collect_parses_json_and_json_lines_and_lists_large_files(tmp_path, monkeypatch):
    (tmp_path / "a.json").write_text('{"ms": 1.5}')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "rows.jsonl").write_text('{"x": 1}\n\n{"x": 2}\n')
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "notes.txt").write_text("ignored")
    (tmp_path / "prep" / "train").mkdir(parents=True)
    (tmp_path / "prep" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (tmp_path / "prep" / "train" / "state.json").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "step_1").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_1" / "config.json").write_text("{}")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"loss": 2.0}\n')
    monkeypatch.setattr(run, "EMBED_LIMIT", 40)
    (tmp_path / "big.json").write_text(json.dumps({"v": list(range(50))}))
    found = run.collect(tmp_path)
    assert found["a.json"] == {"ms": 1.5} and found["sub/rows.jsonl"] == [{"x": 1}, {"x": 2}]
    assert found["bad.json"].startswith("<unparsable") and found["big.json"].startswith("<")
    assert "notes.txt" not in found and not any(name.startswith("prep") or "checkpoints" in name for name in found)
    assert found["run/metrics.jsonl"] == [{"loss": 2.0}]


def test_a_run_appends_one_stamped_row(tmp_path, monkeypatch):
    # A stand-in benchmark (the registry is the runner's only input about a script) that writes
    # into its --out folder and prints.
    script = tmp_path / "fake_bench.py"
    script.write_text("import json, sys, pathlib\nout = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
                      "out.mkdir(parents=True, exist_ok=True)\n(out / 'r.json').write_text(json.dumps({'ms': float(sys.argv[1])}))\n"
                      "print('done', sys.argv[1])\n")
    monkeypatch.setattr(run, "HERE", tmp_path)
    monkeypatch.setitem(run.REGISTRY, "fake", run.Benchmark("fake_bench.py", "cpu", "a stand-in"))
    cache = tmp_path / "cache"
    assert run.main(["--cache", str(cache), "fake", "2.5"]) == 0
    assert run.main(["--cache", str(cache), "fake", "3"]) == 0
    rows = [json.loads(line) for line in (cache / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    row = rows[0]
    assert row["benchmark"] == "fake" and row["rc"] == 0 and row["numbers"] == {"r.json": {"ms": 2.5}}
    assert row["output_tail"] == ["done 2.5"] and row["command"].startswith("python -m benchmarks.run fake 2.5 --out ")
    for key in ("date", "host", "gpus", "git_commit", "git_dirty", "source_hash", "wall_s"):
        assert key in row, key
    assert Path(row["folder"]).parent == cache / "fake" and rows[1]["numbers"] == {"r.json": {"ms": 3.0}}


def test_a_failing_benchmark_still_leaves_its_row_with_its_exit_code(tmp_path, monkeypatch):
    (tmp_path / "fails.py").write_text("import sys\nprint('no GPU')\nsys.exit(3)\n")
    monkeypatch.setattr(run, "HERE", tmp_path)
    monkeypatch.setitem(run.REGISTRY, "fails", run.Benchmark("fails.py", "cpu", "fails", None))
    assert run.main(["--cache", str(tmp_path / "c"), "fails"]) == 3
    row = json.loads((tmp_path / "c" / "rows.jsonl").read_text())
    assert row["rc"] == 3 and row["output_tail"] == ["no GPU"] and "--out" not in row["command"]


@pytest.mark.parametrize("argv, needle", [
    (["nope"], "unknown benchmark 'nope'"),
    (["context"], "give --nproc N"),
    (["--nproc", "2", "cpu"], "--nproc is for the torchrun benchmarks"),
])
def test_bad_invocations_are_refused_in_one_line(argv, needle, tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", "--cache", str(tmp_path), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and needle in done.stderr
    assert not (tmp_path / "rows.jsonl").exists()
