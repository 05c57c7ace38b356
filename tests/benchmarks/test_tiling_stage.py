"""benchmarks/device/tiling.sh (call.sh's `tiling` stage) on the CPU: its commands plan to fit on an
H200, its control flow (limits, stops, skips, the refusal retry, what it collects) against a stand-in
for genolong (tests/benchmarks/fake_genolong.py), and the same tiling flags through a real finetune."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.device import tiling_summary as summary

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / "benchmarks" / "device" / "tiling.sh"
FAKE = Path(__file__).with_name("fake_genolong.py")


def _commands(**env) -> dict[str, list[str]]:
    out = subprocess.run(["bash", str(STAGE), "100"], env={**os.environ, "TILING_DRY": "1", **env}, capture_output=True, text=True,
                         check=True).stdout
    return {line.split(":", 1)[0]: shlex.split(line.split(":", 1)[1]) for line in out.splitlines()}


def _flag(words: list[str], flag: str, default=None):
    return words[words.index(flag) + 1] if flag in words else default


def test_the_finetune_commands_plan_to_fit_one_h200():
    from genolong.cli import app

    commands = _commands()
    assert list(commands) == ["1m", "512k-tiled", "512k-whole", "128k-tiled", "128k-whole", "eval1m"]
    assert commands["1m"] == shlex.split("python3 -m genolong finetune --data /tmp/bundled --seq 1M --steps 3 --warmup 0 --preset glm53-mini --out /tmp/tiling/1m --overwrite")
    plans = {}
    for name, words in commands.items():
        if "finetune" not in words:
            continue
        args = ["plan", "--seq", _flag(words, "--seq"), "--preset", _flag(words, "--preset"), "--tile", _flag(words, "--tile", "auto"),
                "--gpu-type", "h200", "--node-ram-gib", "128"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0 and "fits" in result.output, (name, result.output)
        plans[name] = result.output
    assert "--tile auto picks 32k tiles" in plans["1m"]
    assert "tile_tokens=131072" in plans["512k-tiled"] and "tile_tokens=None" in plans["512k-whole"]
    assert "tile_tokens=32768" in plans["128k-tiled"] and "tile_tokens=None" in plans["128k-whole"]

    def offloaded(text):
        return int(text.split("layers offloaded: ")[1].split(" ")[0])

    # what the 512k pair is for: the tiled layers' smaller working set keeps more layer inputs on the GPU
    assert offloaded(plans["512k-tiled"]) < offloaded(plans["512k-whole"])
    ev = commands["eval1m"]
    assert _flag(ev, "--seq") == "1M" and _flag(ev, "--checkpoint") == "/tmp/tiling/1m" and _flag(ev, "--data") == "/tmp/bundled-swap"


def _stage(tmp_path, budget, runs, **env):
    env = {**os.environ, "GENOLONG": f"{sys.executable} {FAKE}", "OUT": str(tmp_path / "out"), "TILING_DIR": str(tmp_path / "runs"),
           "TILING_DATA": str(tmp_path / "data"), "TILING_EVAL_DATA": str(tmp_path / "evaldata"), "TILING_MIN_S": "1",
           "TILING_STOP_S": "2", "TILING_POLL_S": "0.1", "TILING_PAIR_S": "4", "TILING_RUNS": runs, "FAKE_STEP_S": "0.3", "FAKE_FINAL_STEP_S": "1.5", **env}
    return subprocess.run(["bash", str(STAGE), str(budget)], env=env, capture_output=True, text=True, timeout=budget + 60)


def _info(tmp_path, name):
    return json.loads((tmp_path / "out" / "tiling" / name / "info.json").read_text())


@pytest.mark.slow(seconds=20)
def test_the_stage_stops_cuts_retries_skips_and_collects(tmp_path):
    done = _stage(tmp_path, 20, "1m eval1m 512k-tiled 512k-whole", FAKE_SLOW="512k-whole", FAKE_REFUSE="pinned")
    assert done.returncode == 0, done.stderr
    out, runs = tmp_path / "out" / "tiling", tmp_path / "runs"
    # 1M refused for pinned host memory alone: run again with the budget raised, the refusal kept
    assert "pinned host memory short" in (out / "1m" / "refused.log").read_text()
    one = _info(tmp_path, "1m")
    assert one["rc"] == "0" and one["command"].endswith("--host-budget-gib 101") and one["stopped"] == "exited"
    assert len((out / "1m" / "metrics.jsonl").read_text().splitlines()) == 3
    assert {"plan.json", "memory.json", "kernels.json", "options.json", "samples.tsv", "run.log"} <= {p.name for p in (out / "1m").iterdir()}
    assert _info(tmp_path, "eval1m")["rc"] == "0" and (out / "eval1m" / "partial.jsonl").is_file()
    # the arm stops in the step after its third (--steps 4), before any checkpoint
    tiled = _info(tmp_path, "512k-tiled")
    assert tiled["stopped"] == "after 3 steps" and tiled["rc"] != "0" and "--steps 4" in tiled["command"]
    assert len((out / "512k-tiled" / "metrics.jsonl").read_text().splitlines()) == 3
    whole = _info(tmp_path, "512k-whole")
    assert whole["stopped"].startswith("cut at its limit") and len((out / "512k-whole" / "metrics.jsonl").read_text().splitlines()) == 1
    # the first of a pair had at most half of what was left (20 s at the start), less the stop's 2 s;
    # its partner, the last of the pair, all that was left
    assert 1 <= int(tiled["limit_s"]) <= 20 // 2 - 2
    assert int(whole["limit_s"]) > int(tiled["limit_s"])
    assert sorted(p.name for p in (runs / "done").iterdir()) == ["1m", "512k-tiled", "eval1m"]
    assert not (runs / "512k-tiled").exists() and not (runs / "512k-whole").exists()  # the arms' runs are deleted
    table = summary.rows(summary.load(tmp_path / "out"))
    assert len(table) == 4 and "3 step(s) recorded, after 3 steps" in table[1][7]

    # A second call on the warm machine: what finished is skipped, what was cut runs again.
    again = _stage(tmp_path, 12, "1m 512k-whole", FAKE_SLOW="")
    assert again.returncode == 0, again.stderr
    assert "earlier call" in _info(tmp_path, "1m")["stopped"] and "rc" not in _info(tmp_path, "1m")
    assert _info(tmp_path, "512k-whole")["stopped"] == "after 3 steps"


def test_a_sub_run_without_time_or_checkpoint_is_skipped_with_the_reason(tmp_path):
    # The 1M run is cut in its save: its three steps count (not run again), but there is nothing to evaluate.
    done = _stage(tmp_path, 8, "1m eval1m 512k-tiled", TILING_MIN_S="3", FAKE_SLOW_SAVE="1")
    assert done.returncode == 0, done.stderr
    one = _info(tmp_path, "1m")
    assert one["stopped"].startswith("cut at its limit") and (tmp_path / "runs" / "done" / "1m").is_file()
    assert len((tmp_path / "out" / "tiling" / "1m" / "metrics.jsonl").read_text().splitlines()) == 3
    assert _info(tmp_path, "eval1m")["stopped"] == "skipped: the 1m run has no complete checkpoint"
    assert _info(tmp_path, "512k-tiled")["stopped"].startswith("skipped: ") and "s left" in _info(tmp_path, "512k-tiled")["stopped"]


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    from genolong.data import BUNDLED_HOLDOUT, BUNDLED_TRAIN, bundled_genome_path, prepare

    # as call.sh's `genolong prepare --fasta bundled --out /tmp/bundled` splits it: E. coli to train on
    out = tmp_path_factory.mktemp("bundled") / "prep"
    prepare(bundled_genome_path(), out, train=BUNDLED_TRAIN, holdout=BUNDLED_HOLDOUT, progress=False, log=lambda _m: None)
    return out


def test_the_tiling_flags_start_a_cpu_finetune_and_summarise(bundled, tmp_path):
    # The stage's 128k-tiled command at a CPU's size: the tiny preset, 2k tokens in 512-token tiles.
    run = tmp_path / "run"
    words = _commands(TILING_DATA=str(bundled), TILING_DIR=str(tmp_path), TILE_128K="512", ARM_STEPS="1")["128k-tiled"]
    words = [sys.executable if w == "python3" else w for w in words]
    words[words.index("--seq") + 1], words[words.index("--preset") + 1] = "2k", "tiny"
    words[words.index("--out") + 1] = str(run)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([*words, "--device", "cpu", "--no-progress"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads((run / "options.json").read_text())["memory"]["tile_tokens"] == 512
    memory, plan = json.loads((run / "memory.json").read_text()), json.loads((run / "plan.json").read_text())
    assert memory["tile_tokens"] == 512 and plan["tile_tokens"] == 512 and plan["fits"] is True
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    sub = tmp_path / "out" / "tiling" / "128k-tiled"
    sub.mkdir(parents=True)
    for f in ("metrics.jsonl", "plan.json", "memory.json", "kernels.json", "options.json"):
        (sub / f).write_text((run / f).read_text())
    (sub / "info.json").write_text(json.dumps({"command": " ".join(words), "rc": "0", "stopped": "exited", "wall_s": "9", "date": "d", "gpu": ""}))
    row = summary.rows(summary.load(tmp_path / "out"))[0]
    assert row[3] == f"{records[1]['step_time_s']:.2f} (step 2; step 1 {records[0]['step_time_s']:.1f})"
    assert row[6] == f"GPU {plan['gpu_total'] / 2**30:.1f}, pinned 0.0" and "tile 512" in row[7] and "reference ops: " in row[7]
